"""What a pipeline's work costs in a plan: per-stage forward, backward and message times."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TypeGuard


@dataclass(frozen=True)
class Costs:
    """What a stage's work on one microbatch costs, in plans and simulations.

    ``forward[s]`` and ``backward[s]`` per stage; ``comm`` the latency of a message between
    neighbouring stages; a split backward's halves (``I``, ``W``) cost
    ``backward[s] × (1 + split_overhead) / 2`` each: on a CPU the two took 1.19× the whole
    (the benchmark LM's last stage: 30.6 against 25.7 ms), which is why not every backward
    is split.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    comm: float = 0.0
    split_overhead: float = 0.0

    @classmethod
    def per_stage(
        cls,
        stages: int,
        forward_cost: Sequence[float] | float = 1.0,
        backward_cost: Sequence[float] | float = 2.0,
        comm_cost: float = 0.0,
        split_overhead: float = 0.0,
    ) -> Costs:
        """Costs from one number for every stage, or one per stage (checked)."""
        for name, value in (("comm_cost", comm_cost), ("split_overhead", split_overhead)):
            if not is_number(value) or value < 0 or not math.isfinite(value):
                raise ValueError(f"{name}: got {value!r}; must be a finite number >= 0")
        return cls(
            per_stage("forward_cost", forward_cost, stages),
            per_stage("backward_cost", backward_cost, stages),
            float(comm_cost),
            float(split_overhead),
        )

    @classmethod
    def of_stages(cls, times: Sequence[float], split_overhead: float = 0.0) -> Costs:
        """Costs from each stage's forward-and-backward time (a partition plan's), the
        backward taken as twice the forward. If any time is unknown (zero), every stage counts
        as equal: a plan made from some real and some made-up times would follow the made-up
        ones."""
        if not all(is_number(t) and t > 0 for t in times):
            times = [1.0] * len(times)
        return cls.per_stage(
            len(times),
            [t / 3 for t in times],
            [2 * t / 3 for t in times],
            split_overhead=split_overhead,
        )

    def of(self, kind: str, stage: int) -> float:
        """The time of one compute action of ``kind`` on ``stage``."""
        if kind == "F":
            return self.forward[stage]
        if kind == "B":
            return self.backward[stage]
        if kind in ("I", "W"):
            return self.backward[stage] * (1.0 + self.split_overhead) / 2
        raise ValueError(f"no compute cost for action kind {kind!r}; allowed: F, B, I, W")


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive_int(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}: got {value!r}; must be a positive integer")


def check_partitions(name: str, partitions: Collection[int], count: int) -> None:
    """Each of ``partitions`` is a partition number below ``count``."""
    wrong = [p for p in partitions if not is_int(p) or not 0 <= p < count]
    if wrong:
        raise ValueError(f"{name}: got {wrong[0]!r}; allowed: partitions 0 to {count - 1}")


def per_stage(name: str, cost: Sequence[float] | float, stages: int) -> tuple[float, ...]:
    """One finite, non-negative cost per stage, from a number or a sequence."""
    if is_number(cost):
        costs: Sequence[object] = (cost,) * stages
    elif isinstance(cost, Sequence):
        costs = cost
    else:
        raise ValueError(f"{name}: got {cost!r}; need a number or one per stage ({stages})")
    if len(costs) != stages:
        raise ValueError(f"{name}: got {len(costs)} costs; need one per stage ({stages})")
    checked: list[float] = []
    for value in costs:
        if not is_number(value) or value < 0 or not math.isfinite(value):
            raise ValueError(f"{name}: got {value!r}; costs must be finite numbers >= 0")
        checked.append(float(value))
    return tuple(checked)

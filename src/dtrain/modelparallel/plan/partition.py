"""The partition plan: which pipeline partition owns each module, and what each partition costs.

A plan is made by the automatic planner (:func:`~.solver.auto_plan`), from the placements a
script gives (:func:`manual_plan`, SMP's ``auto_partition=False``), or for any owners at all
(:func:`costed_plan`, to compare a placement with the planner's); its costs follow
:mod:`.costs`, and :mod:`.render` reads it as text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dtrain.errors import did_you_mean
from dtrain.modelparallel.errors import PartitionError
from dtrain.modelparallel.plan.costs import DEFAULT_BANDWIDTH, CostModel, check_weights
from dtrain.modelparallel.plan.memory import (
    MemorySettings,
    StageMemory,
    held_microbatches,
    stage_memory,
)
from dtrain.modelparallel.plan.profile import ModelProfile, static_profile
from dtrain.modelparallel.plan.render import PlanText
from dtrain.modelparallel.plan.rows import CutStep, PlacedModule, StageCost


@dataclass
class PartitionPlan(PlanText):
    """Module → partition for every module of the model, with the costs behind it."""

    partitions: int
    owners: dict[str, int]
    modules: dict[str, PlacedModule]
    stages: list[StageCost]
    traffic: list[list[int]]
    """``traffic[p][q]``: bytes partition ``p`` sends partition ``q`` in one forward pass."""
    memory_weight: float = 0.0
    bandwidth: float = DEFAULT_BANDWIDTH
    profiled: bool = True
    """False for a plan made without running the model: times and costs are unknown."""
    warnings: list[str] = field(default_factory=list)
    memory_settings: MemorySettings | None = None
    """What the stages' ``peak_memory`` assumes (``None`` until :meth:`with_memory`)."""
    placeable: int = 0
    """Parts :func:`~.solver.auto_plan` cut into partitions (units not pinned by a constraint)."""
    possible_cuts: int = 0
    """Cuts of those parts there were to choose from."""
    cut_choice: list[CutStep] = field(default_factory=list)
    """How :func:`~.solver.auto_plan` chose the cut, step by step (empty for other plans)."""

    def owner(self, name: str) -> int:
        """Partition owning module ``name`` (``""`` is the root)."""
        try:
            return self.owners[name]
        except KeyError:
            raise PartitionError(
                f"module {name!r} is not in the partition plan (the plan was made for another "
                "model?)"
            ) from None

    def with_memory(self, settings: MemorySettings) -> PartitionPlan:
        """This plan with every partition's peak memory under ``settings``: the microbatches
        each holds come from the schedule the runtime plans for these stage times."""
        times = [stage.compute_time for stage in self.stages] if self.profiled else []
        held = held_microbatches(settings, self.partitions, times)
        stages = [
            dataclasses.replace(
                stage,
                peak_memory=stage_memory(
                    param_count=stage.param_count,
                    param_bytes=stage.param_bytes,
                    buffer_bytes=stage.buffer_bytes,
                    activation_bytes=stage.activation_bytes,
                    held=held[k],
                    settings=settings,
                ),
            )
            for k, stage in enumerate(self.stages)
        ]
        return dataclasses.replace(self, stages=stages, memory_settings=settings)

    @property
    def peak_memory(self) -> list[StageMemory]:
        """Every partition's peak memory (see :meth:`with_memory`)."""
        peaks = [stage.peak_memory for stage in self.stages if stage.peak_memory is not None]
        if self.memory_settings is None or len(peaks) < len(self.stages):
            raise PartitionError(
                "the plan has no peak memory yet: plan.with_memory(MemorySettings(...)) "
                "says the optimizer, precision and schedule it depends on"
            )
        return peaks

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartitionPlan:
        data = dict(data)
        modules = {name: PlacedModule(**row) for name, row in data.pop("modules").items()}
        stages = []
        for row in data.pop("stages"):
            row = dict(row)
            peak = row.pop("peak_memory", None)
            stages.append(
                StageCost(**row, peak_memory=None if peak is None else StageMemory(**peak))
            )
        settings = data.pop("memory_settings", None)
        return cls(
            modules=modules,
            stages=stages,
            memory_settings=None if settings is None else MemorySettings(**settings),
            cut_choice=[CutStep(**row) for row in data.pop("cut_choice", [])],
            **data,
        )


def manual_plan(
    module: nn.Module, partitions: int, *, fixed: Mapping[str, int], default_partition: int
) -> PartitionPlan:
    """SMP's ``auto_partition=False``: the root on ``fixed.get("", default_partition)``, every
    other module where it is fixed, else with its parent. Costs are not known (no profile)."""
    profile = static_profile(module)
    fixed = dict(fixed)
    check_placements(profile, partitions, fixed)
    if not 0 <= default_partition < partitions:
        raise PartitionError(
            f"default_partition is {default_partition}, but there are {partitions} partitions: "
            f"allowed 0..{partitions - 1}"
        )
    owners: dict[str, int] = {}
    for name, stats in profile.modules.items():  # parents come before their children
        inherited = default_partition if stats.parent is None else owners[stats.parent]
        owners[name] = fixed.get(name, inherited)
    for group in profile.tied_groups:
        first = group[0]
        for other in group[1:]:
            if owners[other] != owners[first]:
                raise PartitionError(
                    f"modules {first!r} (partition {owners[first]}) and {other!r} (partition "
                    f"{owners[other]}) share a parameter, so they must be on the same partition"
                )
    placements = {name: "manual" if name in fixed or not name else "inherited" for name in owners}
    return costed_plan(
        profile, partitions, owners, memory_weight=1.0, placements=placements, profiled=False
    )


def costed_plan(
    profile: ModelProfile,
    partitions: int,
    owners: Mapping[str, int],
    *,
    memory_weight: float,
    bandwidth: float = DEFAULT_BANDWIDTH,
    placements: Mapping[str, str] | None = None,
    warnings: list[str] | None = None,
    profiled: bool = True,
) -> PartitionPlan:
    """The plan for given owners (every module named), with its predicted costs: compare any
    placement, a manual or an equal-layer one, with :func:`~.solver.auto_plan`'s."""
    check_weights(memory_weight, bandwidth)
    check_placements(profile, partitions, owners)
    missing = [name for name in profile.modules if name not in owners]
    if missing:
        raise PartitionError(f"the plan gives no partition to modules {missing[:5]}")
    model = CostModel(profile, memory_weight, bandwidth)
    stages = [StageCost() for _ in range(partitions)]
    modules: dict[str, PlacedModule] = {}
    for name, stats in profile.modules.items():
        time, memory = model.time[name], model.memory[name]
        stage = stages[owners[name]]
        stage.compute_time += time
        stage.memory_bytes += memory
        stage.flops += stats.flops
        stage.param_count += stats.param_count
        stage.param_bytes += stats.param_bytes
        stage.buffer_bytes += stats.buffer_bytes
        stage.activation_bytes += stats.activation_bytes
        modules[name] = PlacedModule(
            type=stats.type,
            placement=(placements or {}).get(name, "manual"),
            param_count=stats.param_count,
            compute_time=time,
            memory_bytes=memory,
            cost=model.cost(time, memory),
            order=stats.order if profiled else None,
        )
    traffic = [[0] * partitions for _ in range(partitions)]
    for caller, callee, sent, returned in model.calls:
        p, q = owners[caller], owners[callee]
        if p != q:
            traffic[p][q] += sent
            traffic[q][p] += returned
            stages[p].comm_time += model.comm_time(sent + returned)
            stages[q].comm_time += model.comm_time(sent + returned)
    for stage in stages:
        stage.cost = model.cost(stage.time, stage.memory_bytes)
    return PartitionPlan(
        partitions=partitions,
        owners={name: owners[name] for name in profile.modules},
        modules=modules,
        stages=stages,
        traffic=traffic,
        memory_weight=memory_weight,
        bandwidth=bandwidth,
        profiled=profiled,
        warnings=list(warnings or []),
    )


def check_placements(profile: ModelProfile, partitions: int, placed: Mapping[str, int]) -> None:
    """``partitions`` is at least 1 and every placed module exists and has a partition in range."""
    if partitions < 1:
        raise PartitionError(f"partitions is {partitions}; it must be at least 1")
    for name, partition in placed.items():
        if name not in profile.modules:
            guess = did_you_mean(name, profile.modules)
            hint = f" (did you mean {guess!r}?)" if guess else ""
            raise PartitionError(f"there is no module {name!r} in the model to place{hint}")
        if not isinstance(partition, int) or not 0 <= partition < partitions:
            raise PartitionError(
                f"module {name!r} is placed on partition {partition!r}, but there are "
                f"{partitions} partitions: allowed 0..{partitions - 1}"
            )

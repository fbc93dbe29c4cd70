"""What a pipeline partition holds at its peak in training, by kind.

A partition's peak, the figure ``dtrain plan`` shows and ``--memory-per-rank`` (or the GPU's free
memory) is checked against, is the sum of:

* **params**: its parameters' bytes as profiled; with ``fp16``/``bf16``, 2 bytes per parameter;
* **grads**: one gradient per parameter, of the parameter's size; with ``fp16``/``bf16``, the
  masters' fp32 gradients (4 bytes), which the half gradients become at the end of each step
  and which stay until ``zero_grad`` (the half ones, 2 bytes, live only during backward);
* **optimizer**: the optimizer's state, per parameter :data:`OPTIMIZER_STATES` tensors of the
  parameter's size (torch's optimizers keep their state like the parameter); with
  ``fp16``/``bf16``, a 4-byte fp32 master copy of each parameter, and the state on the masters
  (4 bytes each);
* **buffers**: as profiled;
* **activations**: the bytes of the output tensors its modules create for one microbatch (the
  profile's, scaled to the microbatch size), times the most microbatches whose activations it
  holds at once under the pipeline schedule: forwards done minus backwards done, at the worst
  moment of the schedule the runtime plans (``simulate(...).peak_held``).

These are estimates from below: autograd saves more than module outputs (an attention's
softmax, a nonlinearity's input), the allocator rounds and caches, and the process, its CUDA
context and its communication buffers are not counted. A layout they say does not fit does not
fit; one they say fits may still run short.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.errors import ConfigError
from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.planner import SPLIT_OVERHEAD, build_schedule
from dtrain.modelparallel.scheduling.policy import PIPELINES, SchedulePolicy
from dtrain.modelparallel.scheduling.schedule import simulate

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}
"""State tensors per parameter: Adam's and AdamW's two moments, SGD's momentum buffer."""

HALF_PRECISIONS = ("fp16", "bf16")
HALF_BYTES = 2
MASTER_BYTES = 4
"""An fp32 master copy of a half-precision parameter, which the optimizer updates."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
SIZE_FORMS = (
    "a size such as 8GiB, 512MiB, 8GB or 1073741824 (bytes); units B, KB, MB, GB, TB "
    "(powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024)"
)


def parse_size(flag: str, text: str) -> int:
    """``"8GiB"`` → 8589934592: a positive byte count, or a :class:`ConfigError` naming
    ``flag`` and the forms allowed."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(flag, text, SIZE_FORMS)
    size = math.floor(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ConfigError(flag, text, f"a size of at least 1 byte: {SIZE_FORMS}")
    return size


def format_size(count: float) -> str:
    """Bytes in binary units: ``1.5 GiB``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while count >= 1024 and power < len(units) - 1:
        count /= 1024
        power += 1
    return f"{count:.0f} B" if power == 0 else f"{count:.1f} {units[power]}"


@dataclass(frozen=True)
class MemorySettings:
    """What besides the plan decides a partition's memory: the optimizer, the parameters'
    precision and the pipeline's schedule."""

    optimizer: str = "adam"
    """A key of :data:`OPTIMIZER_STATES`."""
    half_precision: str | None = None
    """``fp16`` or ``bf16`` (SMP's parameters of those names): half-precision parameters with
    fp32 masters; ``None``: parameters as profiled."""
    pipeline: str = "interleaved"
    microbatches: int = 1
    active_microbatches: int | None = None
    """``None``: SMP's default, ``partitions + 2`` (at most ``microbatches``)."""
    split_backward: bool = True
    """Whether the plan splits backwards, as the runtime's does: a split backward keeps its
    activations until its weight half."""
    profiled_microbatches: int | None = None
    """The profiled batch was one microbatch of a step split this many ways (``None``: into
    ``microbatches``, as a job profiles its first microbatch); activations scale with the
    microbatch's size."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise ConfigError("optimizer", self.optimizer, ", ".join(OPTIMIZER_STATES))
        if self.half_precision not in (None, *HALF_PRECISIONS):
            raise ConfigError(
                "half_precision", self.half_precision, f"None or {', '.join(HALF_PRECISIONS)}"
            )
        if self.pipeline not in PIPELINES:
            raise ConfigError("pipeline", self.pipeline, ", ".join(PIPELINES))
        for name in ("microbatches", "active_microbatches", "profiled_microbatches"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(name, value, "an integer >= 1")

    @classmethod
    def of_job(cls, config: Mapping[str, Any], optimizer: object) -> MemorySettings:
        """A job's settings: its model-parallel ``config`` and the optimizer it registered
        (``None`` before ``smp.DistributedOptimizer``)."""
        return cls(
            optimizer=optimizer_kind(optimizer),
            half_precision="fp16" if config["fp16"] else "bf16" if config["bf16"] else None,
            pipeline=config["pipeline"] if config["pipeline"] in PIPELINES else "interleaved",
            microbatches=config["microbatches"],
            active_microbatches=config["active_microbatches"],
        )

    def policy(self, stages: int) -> SchedulePolicy:
        """The pipeline that runs on ``stages`` (``simple`` with fewer active microbatches
        than microbatches runs as ``interleaved``, SMP's rule) and its in-flight bound."""
        active = self.active_microbatches or stages + 2
        return SchedulePolicy.for_config(self.pipeline, self.microbatches, active)

    def describe(self, stages: int) -> str:
        """The settings in words, with the pipeline that runs on ``stages``."""
        states = OPTIMIZER_STATES[self.optimizer]
        precision = (
            f"{self.half_precision} parameters with fp32 masters"
            if self.half_precision
            else "parameters as profiled"
        )
        return (
            f"{self.optimizer} ({states} state tensor{'s' * (states != 1)} per parameter), "
            f"{precision}, {self.describe_schedule(stages)}"
        )

    def describe_schedule(self, stages: int) -> str:
        """``interleaved pipeline, 8 microbatches, at most 4 in flight``: what runs."""
        policy = self.policy(stages)
        pipeline = f"{policy.pipeline} pipeline"
        if policy.pipeline != self.pipeline:
            pipeline += f" ({self.pipeline} asked; SMP runs it so with fewer in flight than all)"
        return (
            f"{pipeline}, {self.microbatches} microbatch{'es' * (self.microbatches != 1)}, "
            f"at most {policy.active} in flight"
        )


def optimizer_kind(optimizer: object) -> str:
    """The :data:`OPTIMIZER_STATES` key of a torch optimizer. One whose state is unknown counts
    as plain SGD (none), so that a job is never refused for an estimate it may not need."""
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD) and any(
        group.get("momentum", 0) for group in optimizer.param_groups
    ):
        return "sgd-momentum"
    return "sgd"


@dataclass
class StageMemory:
    """Bytes one partition holds at its peak in training, by kind (see the module's docs)."""

    params: int = 0
    grads: int = 0
    master: int = 0
    """fp32 master copies of half-precision parameters."""
    optimizer: int = 0
    """The optimizer's state (on the masters with half precision)."""
    buffers: int = 0
    activations: int = 0
    held_microbatches: int = 0
    """Microbatches whose activations it holds at its peak."""

    @property
    def total(self) -> int:
        return (
            self.params + self.grads + self.master + self.optimizer + self.buffers
        ) + self.activations

    def describe(self) -> str:
        """``params 1.0 GiB, grads 1.0 GiB, ...``: the breakdown in words."""
        optimizer = format_size(self.optimizer)
        if self.master:
            optimizer += f" + fp32 masters {format_size(self.master)}"
        return (
            f"params {format_size(self.params)}, grads {format_size(self.grads)}, optimizer "
            f"{optimizer}, buffers {format_size(self.buffers)}, activations "
            f"{format_size(self.activations)} ({self.held_microbatches} microbatch"
            f"{'es' * (self.held_microbatches != 1)} held)"
        )


def held_microbatches(
    settings: MemorySettings, stages: int, stage_times: Sequence[float] = ()
) -> list[int]:
    """Per stage, the most microbatches whose activations it holds at once, in the schedule
    the runtime plans for stages taking ``stage_times`` (equal stages when unknown): with
    ``simple`` every microbatch; with ``interleaved``, bounded by ``active_microbatches`` and
    fewer on later stages, whose backwards come sooner."""
    costs = Costs.of_stages(list(stage_times) or [0.0] * stages, SPLIT_OVERHEAD)
    policy = settings.policy(stages)
    schedule = build_schedule(
        policy.pipeline,
        stages,
        policy.microbatches,
        policy.active,
        split_backward=settings.split_backward,
        costs=costs,
    )
    return list(simulate(schedule, costs).peak_held)


def stage_memory(
    *,
    param_count: int,
    param_bytes: int,
    buffer_bytes: int,
    activation_bytes: int,
    held: int,
    settings: MemorySettings,
) -> StageMemory:
    """A partition's peak from its profiled sums (``activation_bytes`` for the profiled batch)
    and the microbatches it holds."""
    states = OPTIMIZER_STATES[settings.optimizer]
    if settings.half_precision:
        params = HALF_BYTES * param_count
        grads = master = MASTER_BYTES * param_count
        optimizer = states * master
    else:
        params = grads = param_bytes
        master, optimizer = 0, states * param_bytes
    profiled = settings.profiled_microbatches or settings.microbatches
    per_microbatch = math.ceil(activation_bytes * profiled / settings.microbatches)
    return StageMemory(
        params=params,
        grads=grads,
        master=master,
        optimizer=optimizer,
        buffers=buffer_bytes,
        activations=per_microbatch * held,
        held_microbatches=held,
    )

"""The rows of a partition plan: a module's own share, a partition's predicted work, a step of
the automatic planner's choice of a cut."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.modelparallel.plan.memory import StageMemory


@dataclass
class PlacedModule:
    """One row of a plan: a module's own share (its code and parameters, not its children's)."""

    type: str
    placement: str
    """``auto`` (chosen by the planner), ``manual`` (fixed), ``inherited`` (follows its parent
    or the atom it belongs to) or ``tied`` (follows a module it shares a parameter with)."""
    param_count: int
    compute_time: float = 0.0
    """Seconds of its own forward and backward code on the profiled batch (the median over the
    modules built and called alike: repeated identical layers show one time)."""
    memory_bytes: int = 0
    cost: float = 0.0
    order: int | None = None
    """Where its first call came in the profiled forward (:attr:`ModuleStats.order`), which
    the pipeline's route follows; ``None`` if it never ran, or in a plan made without running
    the model."""


@dataclass
class StageCost:
    """What one partition does for the profiled batch (a microbatch in training), predicted."""

    compute_time: float = 0.0
    comm_time: float = 0.0
    """Seconds sending and receiving remote-call tensors, forward and backward."""
    memory_bytes: int = 0
    cost: float = 0.0
    flops: int = 0
    """Floating-point operations of the partition's forward (see :class:`~.profile.ModuleStats`)."""
    param_count: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    activation_bytes: int = 0
    """Bytes of the output tensors its modules create for the profiled batch."""
    peak_memory: StageMemory | None = None
    """What it holds at its peak in training, by kind, once
    :meth:`~.partition.PartitionPlan.with_memory` has been told the optimizer, precision and
    schedule."""

    @property
    def time(self) -> float:
        return self.compute_time + self.comm_time


@dataclass(frozen=True)
class CutStep:
    """One step of :func:`~.solver.auto_plan`'s choice of a cut (see ``solver._CUT_CHOICE``): the
    least largest partition value of ``measure`` among the cuts still allowed, the limit it set
    and how many cuts were left within it."""

    measure: str
    """``cost``, ``flops``, ``memory`` or ``traffic``."""
    tolerance: float
    least: float
    limit: float
    cuts: int
    """Cuts allowed by this step and every step before it."""

"""Where the pipelined engine's modules go: rank 0's profiling step and plan, or the manual one.

At the first step every rank takes the same plan: with ``auto_partition`` (and more than one
stage) rank 0 runs the first microbatch's step body with the model profiled (its tp group with
it, each on its own first microbatch: their modules' collectives need the whole group), plans,
and broadcasts the plan; otherwise the manual placements (``smp.partition``,
``default_partition``) are the plan. A model created without memory is profiled on the meta
device: the plan then weighs operation counts, not times. The plan's schedule follows from its
stage times (:func:`planned_schedule`).
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from dtrain.modelparallel import deferred
from dtrain.modelparallel.api import initial, placement
from dtrain.modelparallel.api.engine import MakeBody
from dtrain.modelparallel.errors import ModelParallelError, StepFailedError
from dtrain.modelparallel.modules import activations
from dtrain.modelparallel.pipeline import solo
from dtrain.modelparallel.pipeline.stall import default_store
from dtrain.modelparallel.plan import fit
from dtrain.modelparallel.plan.partition import PartitionPlan, manual_plan
from dtrain.modelparallel.plan.profile import (
    ModelProfile,
    Snapshot,
    moved_to,
    outputs_without_memory,
    profile_module,
    profile_without_memory,
)
from dtrain.modelparallel.plan.solver import auto_plan
from dtrain.modelparallel.scheduling.planner import check_route
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.route import RouteSchedule, pipeline_plan, route_of
from dtrain.modelparallel.scheduling.schedule import Schedule
from dtrain.modelparallel.state import MPState
from dtrain.modelparallel.transport.message import error_body
from dtrain.sealed import all_gather_objects

_PLANS = itertools.count()
"""Names the store keys of each automatic plan: every rank partitions its models in one order."""

TRACE_DEVICES = ("cpu", "gpu")
"""``DistributedModel(trace_device=...)``: where rank 0 profiles the whole model."""


def trace_device_of(trace_device: str, device: torch.device, tp_size: int = 1) -> torch.device:
    """Where a rank that computes on ``device`` profiles: ``"gpu"`` is its GPU (the CPU on a
    rank without one), ``"cpu"`` the CPU (for a model that does not fit on one GPU).

    With tensor parallelism the profiled forward runs the tp group's collectives, which NCCL
    runs on the GPU only: a GPU rank then profiles on its GPU, and says so."""
    if trace_device == "gpu" or device.type == "cpu":
        return device
    if tp_size > 1:
        warnings.warn(
            f"DistributedModel: trace_device='cpu' profiles on {device} with "
            f"tensor_parallel_degree={tp_size}: the tensor-parallel group's collectives run "
            "on the GPU",
            stacklevel=3,
        )
        return device
    return torch.device("cpu")


def with_own_code(root: nn.Module) -> dict[str, str]:
    """Every module of ``root`` whose parent's own code computes on its outputs (see
    ``DistributedTransformerLMHead.computes_with_own_code``; one the parent lacks, a head left
    out, is none), by name, to its parent's name."""
    found = {}
    for prefix, module in root.named_modules():
        names = getattr(module, "computes_with_own_code", ())
        for name, _ in module.named_children():
            if name in names:
                found[f"{prefix}.{name}" if prefix else name] = prefix
    return found


def check_own_code_placement(root: nn.Module, owner: Callable[[str], int]) -> None:
    """Where ranks follow plan rows, a module placed away from its parent's code that computes
    on its outputs would take a microbatch back and forth (0 -> 1 -> 0 -> 1 -> 0), which no plan
    serves: fail before the first step, naming it."""
    for name, parent in with_own_code(root).items():
        if owner(name) != owner(parent):
            raise ModelParallelError(
                f"module {name!r} is placed on partition {owner(name)}, but its parent's code, "
                f"on partition {owner(parent)}, computes on its outputs: with "
                "deterministic_server or tensor_parallel_degree above 1 every rank follows a "
                "plan, which cannot take a microbatch there and back twice; place "
                f"{name!r} on partition {owner(parent)} (or leave it to the automatic partition)"
            )


def plan_ordered(st: MPState) -> bool:
    """Whether every rank computes in its plan row's order: with ``deterministic_server``,
    and where a tp group's ranks must run their collectives in one order."""
    return bool(st.config["deterministic_server"]) or st.tp_size > 1


def split_blocks(root: nn.Module, st: MPState) -> set[str]:
    """The modules split over the tp group, each kept whole on one partition (none at tp 1)."""
    if st.tp_size == 1:
        return set()
    from dtrain.modelparallel.tensor import shards  # DTensor: with tensor parallelism only

    return shards.split_blocks(root)


class Partitioner:
    """Every rank's plan (:meth:`plan`), and the profiling step behind an automatic one: the
    first microbatch's step body on rank 0 (and its tp group), the model's forward profiled
    (:meth:`forward`)."""

    def __init__(self, module: nn.Module, st: MPState, trace_device: str) -> None:
        self.module = module
        self._state = st
        self._trace_device = trace_device
        self._tracing = threading.Event()
        self.profile: ModelProfile | None = None
        """What the profiling step measured; ``None`` before, or where nothing was profiled."""

    @property
    def tracing(self) -> bool:
        """Whether the profiling step runs (the model's forward is then :meth:`forward`)."""
        return self._tracing.is_set()

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model called in the profiling step: profiled the first time, then run without
        gradients (a model created without memory: its outputs' shapes on the meta device)."""
        if delayed(self.module):
            if self.profile is None:
                self.profile = profile_without_memory(self.module, args, kwargs)
            return outputs_without_memory(self.module, args, kwargs)
        if self.profile is None:
            self.profile = profile_module(self.module, args, kwargs)
        with torch.no_grad():
            return self.module(*args, **kwargs)

    def plan(self, make_body: MakeBody) -> PartitionPlan:
        """Every rank's plan: rank 0's from its profiling step, or the manual one."""
        st = self._state
        fixed = placement.manual_placements(self.module)
        if st.config["auto_partition"] and st.pp_size > 1:
            return self._rank_zero_plan(make_body, fixed)
        default = st.config.get("default_partition") or 0
        return manual_plan(self.module, st.pp_size, fixed=fixed, default_partition=default)

    def _rank_zero_plan(self, make_body: MakeBody, fixed: dict[str, int]) -> PartitionPlan:
        """Rank 0 profiles its first microbatch and plans; every rank gets rank 0's plan.

        The others wait for as long as rank 0 works and shows signs of life
        (:mod:`..pipeline.solo`): profiling a large model, on the CPU above all, may take
        longer than any wait for a peer (``DTRAIN_MP_TIMEOUT``) should. With tensor
        parallelism rank 0's tp group profiles with it (its modules' collectives need the
        whole group), each on its own first microbatch, and only rank 0 plans.
        """
        st = self._state
        store, name = default_store(), f"dtrain/mp-plan/{next(_PLANS)}"
        failed: Exception | None = None
        if st.rank == 0:
            try:
                with solo.working(store, name, st.options.timeout):
                    self._step_with_tp_group(make_body)
                    plan = self._plan_from_profile(fixed)
            except BaseException as exc:
                initial.broadcast_objects([("error", error_body(0, exc))], st)
                raise
            payload: list[Any] = [("plan", plan.to_dict())]
        else:
            if st.rank in st.topology.group("tp", 0):
                try:
                    self._step_with_tp_group(make_body)
                except Exception as exc:  # rank 0 broadcasts it: the other ranks wait for that
                    failed = exc
            what = "rank 0 to profile the model and plan its partition"
            solo.wait_for(store, name, st.options.timeout, st.rank, what)
            payload = [None]
        kind, value = initial.broadcast_objects(payload, st)[0]
        if failed is not None:
            raise failed
        if kind == "error":
            raise StepFailedError(value.rank, value.exc_type, value.message, value.remote_traceback)
        return PartitionPlan.from_dict(value)

    def _step_with_tp_group(self, make_body: MakeBody) -> None:
        """The profiling step on rank 0's tp group, which then shares how it went: every member
        raises the first failing member's error (its own exception there, a
        :class:`StepFailedError` naming it elsewhere), so that rank 0 broadcasts it and no rank
        waits for ever for a plan."""
        st = self._state
        error: Exception | None = None
        try:
            self._traced_step(make_body)
        except Exception as exc:
            error = exc
        if st.tp_size > 1:
            mine = None if error is None else error_body(st.rank, error)
            outcomes = all_gather_objects(mine, st.object_groups["tp"], st.seals)
            first = next((outcome for outcome in outcomes if outcome is not None), None)
            if first is not None and first.rank != st.rank:
                raise StepFailedError(
                    first.rank, first.exc_type, first.message, first.remote_traceback
                ) from error
        if error is not None:
            raise error

    def _traced_step(self, make_body: MakeBody) -> None:
        """The profiling step: the first microbatch's step body, the model profiled in it.

        It runs the module and its tensor arguments on the trace device: SMP's scripts leave
        the model on the CPU and move their batches to the GPU, which would not run together.
        A model created without memory runs on the meta device instead (see :meth:`forward`):
        the plan then weighs operation counts, not times.
        """
        st = self._state
        # The traced step leaves no trace: BatchNorm statistics and RNG states as found.
        snapshot = Snapshot(self.module, [], st.device.type == "cuda")
        device = trace_device_of(self._trace_device, st.device, st.tp_size)
        placed = nullcontext() if delayed(self.module) else moved_to(self.module, device)
        self._tracing.set()
        try:
            with placed:
                make_body(device)(0)
        finally:
            self._tracing.clear()
            snapshot.restore()
            if device.type == "cuda":  # the whole model's blocks, cached for nothing
                torch.cuda.empty_cache()

    def _plan_from_profile(self, fixed: dict[str, int]) -> PartitionPlan:
        """Rank 0's plan from its profiling step."""
        st = self._state
        if self.profile is None:
            raise ModelParallelError(
                "the step function did not call the model, so it cannot be partitioned"
            )
        if plan_ordered(st):  # with the root's code on partition 0, and its parent
            pinned = {name for pair in with_own_code(self.module).items() for name in pair}
            fixed = {**dict.fromkeys(pinned - {""}, 0), **fixed}
        whole = activations.kept_whole(self.module) | split_blocks(self.module, st)
        while True:
            plan = auto_plan(
                self.profile,
                st.pp_size,
                memory_weight=st.config["memory_weight"],
                fixed=fixed,
                whole=whole,
            )
            came_back = returning(self.module, plan) if plan_ordered(st) else None
            if came_back is None or came_back in whole:
                break
            whole.add(came_back)  # planned again with it whole, on one partition
        return fit.check_device_memory(plan, self.profile, st, self.module, fixed, whole)


def delayed(module: nn.Module) -> bool:
    """Whether some of ``module`` was created without memory and not made yet."""
    return any(
        deferred.is_deferred(t) for t in itertools.chain(module.parameters(), module.buffers())
    )


def returning(root: nn.Module, plan: PartitionPlan) -> str | None:
    """Where the plan's route is one no plan order serves, a module whose code, on one
    partition, runs again after its submodules on a later one returned (its end), before
    the route goes on: kept whole, it takes them back (``None``: no such module)."""
    events = route_events(root, plan)
    try:
        check_route(route_of((plan.owner(name), 0.0) for name, _ in events)[0])
    except ValueError:
        for (before, _), (name, end) in itertools.pairwise(events):
            if end and plan.owner(name) < plan.owner(before):
                return name
    return None


def route_events(root: nn.Module, plan: PartitionPlan) -> list[tuple[str, bool]]:
    """The modules the forward enters and leaves, in order, as ``(name, is_end)``: from a
    profiled plan, in the order of their first calls, each left before the next module
    outside it is entered (the root is never left: the step ends there); from a plan made
    without running the model, entered in the order they are registered."""
    names = [name for name, _ in root.named_modules()]
    if not plan.profiled:
        return [(name, False) for name in names]
    called = {
        name: order
        for name in names
        if name in plan.modules and (order := plan.modules[name].order) is not None
    }
    events: list[tuple[str, bool]] = []
    open_: list[str] = []
    ran = sorted(called, key=called.__getitem__)
    for name in ran:
        while open_ and open_[-1] and not name.startswith(f"{open_[-1]}."):
            events.append((open_.pop(), True))
        events.append((name, False))
        open_.append(name)
    events.extend((name, True) for name in reversed(open_) if name)
    return events


def planned_schedule(root: nn.Module, plan: PartitionPlan, st: MPState) -> Schedule | RouteSchedule:
    """The pipeline's policy (which backwards are split chosen for the plan's stage
    times) and the action lists it runs with those times (see :func:`pipeline_plan`)."""
    policy = SchedulePolicy.for_config(
        st.config["pipeline"], st.config["microbatches"], st.config["active_microbatches"]
    )
    times = [stage.compute_time for stage in plan.stages] if plan.profiled else []
    modules = [
        (plan.owner(name), 0.0 if end or not plan.profiled else plan.modules[name].compute_time)
        for name, end in route_events(root, plan)
    ]
    owners = {name: plan.owner(name) for name, _ in root.named_modules()}
    return pipeline_plan(
        policy,
        times or [0.0] * st.pp_size,
        modules,
        plan_ordered(st),
        # their backwards recompute, so they run whole; the other partitions still split
        activations.checkpointing_partitions(root, owners),
    )

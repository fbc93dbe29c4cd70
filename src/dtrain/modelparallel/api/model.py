"""``smp.DistributedModel``: a module split across the pipeline, trained one step at a time.

Nothing happens to the module until the first step: then every rank takes rank 0's parameters
and buffers, the model is partitioned (rank 0 profiles the first microbatch and plans, or the
manual placement is used), each rank frees the parameters it does not own, and the pipeline
runtime starts. A model created inside ``smp.delay_param_initialization()`` has no memory until
then: rank 0 plans from its shapes and operation counts, and each rank makes only what it owns
(:mod:`..deferred`), so no rank ever holds the whole model. After each step each rank averages
its own parameters' gradients over its data-parallel group. With ``sharded_data_parallel_degree``
above 1 there is no pipeline: the module is sharded when wrapped, and steps, gradients and
state dicts go through :mod:`.sharded`.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.hooks import RemovableHandle

from dtrain.dataparallel.buckets import plan_buckets
from dtrain.errors import ConfigError, did_you_mean
from dtrain.modelparallel import deferred, state
from dtrain.modelparallel.api import placement
from dtrain.modelparallel.api.precision import (
    HalfParameters,
    LossScaling,
    average_in_place,
    half_dtype,
)
from dtrain.modelparallel.errors import ModelParallelError, NotInStepError, StepFailedError
from dtrain.modelparallel.modules import activations, hooks
from dtrain.modelparallel.modules.tasks import MicrobatchResult
from dtrain.modelparallel.pipeline import solo
from dtrain.modelparallel.pipeline.group import PipelineGroup
from dtrain.modelparallel.pipeline.runtime import PipelineRuntime
from dtrain.modelparallel.pipeline.split_backward import scaled_grads
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
from dtrain.modelparallel.scheduling.ordering import ordering_for
from dtrain.modelparallel.scheduling.planner import check_route
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.route import RouteSchedule, pipeline_plan, route_of
from dtrain.modelparallel.scheduling.schedule import Schedule
from dtrain.modelparallel.tensor import marks, translated
from dtrain.modelparallel.timeline import TimelineEvent, write_chrome_trace
from dtrain.modelparallel.transport.message import error_body
from dtrain.sealed import all_gather_objects, broadcast_object

if TYPE_CHECKING:
    from dtrain.modelparallel.api.sharded import ShardedModel

PARTIAL_KEY = "_smp_is_partial"

DEGREES_KEY = "_dtrain_degrees"
"""The pipeline and tensor-parallel degrees a partial state dict was saved at: its tensors are
one partition's (and one tp rank's shards), which load only at the same degrees."""


def degrees(st: state.MPState) -> dict[str, int]:
    """The degrees that lay a model's tensors out over the ranks, as a partial state names them."""
    return {"pipeline_parallel_degree": st.pp_size, "tensor_parallel_degree": st.tp_size}


def check_degrees(saved: dict[str, int], st: state.MPState, what: str) -> None:
    """A partial state saved at ``saved`` degrees loads only at the same ones."""
    here = degrees(st)
    if saved != here:
        shown = " x ".join(f"{name} {value}" for name, value in saved.items())
        raise ModelParallelError(
            f"{what}: the partial state was saved at {shown}, this job runs at "
            f"{' x '.join(f'{name} {value}' for name, value in here.items())}; allowed: the "
            "same degrees (a partial state holds one partition's tensors, split over its tp "
            "group); save a full one (partial=False) to load it at other degrees"
        )


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


class DistributedModel(nn.Module):
    """Wraps the model to train with pipeline (and data) parallelism; one per process.

    The arguments SMP v1 takes for its internal DDP are accepted; ``bucket_cap_mb`` sizes the
    gradient reduction over the data-parallel group and ``average_grads_across_microbatches``
    chooses between the mean (default) and the sum of the microbatches' gradients.
    ``trace_device`` (``"gpu"``, SMP's default, or ``"cpu"``) is where rank 0 runs the
    profiling step, the module and the step's tensor arguments together, wherever the script
    left them; the module is back where it was afterwards.
    """

    def __init__(
        self,
        module: nn.Module,
        trace_device: str = "gpu",
        trace_execution_times: bool = False,
        overlapping_allreduce: bool = True,
        backward_passes_per_step: int = 1,
        average_grads_across_microbatches: bool = True,
        bucket_cap_mb: float = 25,
        trace_memory_usage: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedModel wraps an nn.Module, got {type(module).__name__}")
        if trace_device not in TRACE_DEVICES:
            raise ConfigError(
                "DistributedModel.trace_device",
                trace_device,
                '"cpu" or "gpu"',
                did_you_mean(str(trace_device), TRACE_DEVICES),
            )
        self._state = state.current()
        self._from_rank_zero = False
        """Whether every rank holds rank 0's initial values (:meth:`_broadcast_initial_state`)."""
        self.tensor_shards: Any = None
        """With ``tensor_parallel_degree`` above 1, :mod:`.tensor.shards` (imported for tensor
        parallelism only: DTensor takes a second to import), which knows the parameters split
        over the tp group (the optimizer asks it too); a sharded model's are FSDP2's shards of
        them, which :mod:`.sharded` handles."""
        sharded = self._state.config["sharded_data_parallel_degree"] > 1
        if self._state.tp_size > 1 or marks.any_marked(module):
            from dtrain.modelparallel.tensor import shards, swap

            self._sync_random_states(module)  # a delayed model's shards are made now
            placed = placement.manual_placements(module)
            before = dict(module.named_modules())
            shards.restore_marks(module)  # the script may have moved it (``to``) before
            self._broadcast_initial_state(module)  # before shards are cut from its values
            module = swap.distribute(module)  # SMP swaps in place when wrapping, too
            placement.keep_placements(module, placed, before)
            shards.split_delayed(module, self._state.device)
            if self._state.tp_size > 1 and not sharded:
                self.tensor_shards = shards
        state.register_model(self)
        self.module = module
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.bucket_cap_mb = bucket_cap_mb
        self._trace_device = trace_device
        self._runtime: PipelineRuntime | None = None
        self._plan: PartitionPlan | None = None
        self._schedule: Schedule | RouteSchedule | None = None
        self._local_modules: set[int] | None = None
        """ids of the modules this rank owns; ``None`` before partitioning (all of them)."""
        self._tracing = threading.Event()
        self._profile: ModelProfile | None = None
        self._pending_loads: list[tuple[dict[str, Any], bool, bool]] = []
        """State dicts loaded before partitioning: ``(values, strict, full)``."""
        self._post_partition_hooks: OrderedDict[int, Callable[[DistributedModel], None]] = (
            OrderedDict()  # a RemovableHandle holds a weak reference to it: not a plain dict
        )
        dtype = half_dtype(self._state.config)
        self.half_precision = (
            None
            if dtype is None or sharded
            else HalfParameters(dtype, self._state.device, self._state.world_process_group)
        )
        """``fp16``/``bf16`` with pipelines: the half model's fp32 masters and loss scale
        (:mod:`.precision`). A sharded model's fp32 shards are its masters (:mod:`.sharded`)."""
        self.sharding: ShardedModel | None = None
        """With ``sharded_data_parallel_degree`` above 1 the module is sharded now, and its
        steps, gradients, precision and state dicts go through :mod:`.sharded`."""
        if sharded:
            # Imported here: FSDP2 and DTensor take seconds to import, for sharded models only.
            from dtrain.modelparallel.api.sharded import ShardedModel

            self._sync_random_states()
            self.sharding = ShardedModel(
                module,
                self._state,
                lambda: self._state_tensors(local_only=False),
                self._from_rank_zero,
            )

    # --- calling the model -------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._tracing.is_set():
            if self._delayed():
                if self._profile is None:
                    self._profile = profile_without_memory(self.module, args, kwargs)
                return outputs_without_memory(self.module, args, kwargs)
            if self._profile is None:
                self._profile = profile_module(self.module, args, kwargs)
            with torch.no_grad():
                return self.module(*args, **kwargs)
        if self.sharding is not None:
            self.sharding.require_step("the model")
            return self.module(*args, **kwargs)
        self._require_step("the model")
        half = self.half_precision
        if half is None:
            return self.module(*args, **kwargs)
        args, kwargs = half.inputs((args, kwargs))
        return half.outputs(self.module(*args, **kwargs))

    def backward(
        self,
        tensors: torch.Tensor | list[torch.Tensor],
        grad_tensors: torch.Tensor | list[torch.Tensor | None] | None = None,
    ) -> None:
        """Replaces ``loss.backward()`` inside a step; gradients are averaged over microbatches.

        A loss another partition computed and nobody fetched yet is fetched with its backward,
        in one request to its owner.
        """
        if self._tracing.is_set():
            return
        outputs = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if grad_tensors is None:
            grads: list[torch.Tensor | None] = [None] * len(outputs)
        elif isinstance(grad_tensors, (list, tuple)):
            grads = list(grad_tensors)
        else:
            grads = [grad_tensors]
        scale = None
        if self.average_grads_across_microbatches:
            scale = 1.0 / self._state.config["microbatches"]
        scaling = self.loss_scaling
        if scaling is not None and scaling.loss_scale != 1.0:
            scale = (scale or 1.0) * scaling.loss_scale
        if self.sharding is not None:
            self.sharding.backward(outputs, scaled_grads(outputs, grads, scale))
            return
        self._require_step("model.backward").backward(outputs, grads, scale)

    @property
    def loss_scaling(self) -> LossScaling | None:
        """The loss scale and overflow flag of a half model: the half parameters' with
        pipelines, the sharded model's with fp16; ``None`` for fp32 and sharded bf16."""
        if self.sharding is not None:
            return self.sharding.scaling
        return self.half_precision

    def _require_step(self, what: str) -> PipelineRuntime:
        runtime = self._runtime
        if runtime is None or not runtime.in_step():
            raise NotInStepError.used(what)
        return runtime

    # --- steps -------------------------------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        return self._runtime is not None or self.sharding is not None

    @property
    def forwards_set_up(self) -> bool:
        """Whether the first step has set up the modules' forwards (activation checkpointing's
        marks are applied then): the pipeline runtime's, or the sharded model's."""
        if self.sharding is not None:
            return self.sharding.stepped
        return self._runtime is not None

    def run_step(
        self, count: int, make_body: Callable[[torch.device], Callable[[int], Any]]
    ) -> list[MicrobatchResult]:
        """Called by ``@smp.step`` on every rank: partition if needed, run, reduce gradients.

        ``make_body(device)`` splits the step's arguments, their tensors moved to ``device``,
        and returns the step body of one microbatch (called on the leader only)."""
        if self.sharding is not None:
            if not self.sharding.stepped:  # sharded when wrapped: the hooks run before step 1
                self._run_post_partition_hooks()
            return self.sharding.run_step(count, make_body)
        self._restore_marks()  # before the masters copy them, and the averages read them
        if self._runtime is None:
            self._partition(make_body)
        runtime = self._runtime
        assert runtime is not None
        # the gradients averaged below: this rank's, or their fp32 masters (which hold the
        # earlier steps' when accumulating before one optimizer step)
        half = self.half_precision
        params = list(self.local_parameters()) if half is None else half.masters()
        if self.tensor_shards is not None:
            shards = self.tensor_shards
            scaled = [p.grad for p in params if p.grad is not None and shards.is_scaled_batch(p)]
            shards.carry_earlier(scaled, shards.tp_batches(self._state))
        if runtime.is_leader:
            try:
                body = make_body(self._state.device)
            except BaseException as exc:
                runtime.abort_step(exc)
                raise
            outcomes = runtime.run_step(count, body)
        else:
            outcomes = runtime.run_step(count, None)
        if all(ok for ok, _ in outcomes):
            if half is None:
                self._reduce_gradients(params)
            else:
                half.after_backward(self._reduce_gradients)
            trace = self._state.options.trace
            if trace and self._state.dp_rank == 0:  # every rank of the first pipeline
                self.export_timeline(trace)
        return outcomes

    # --- partitioning ------------------------------------------------------------------------

    def _delayed(self) -> bool:
        """Whether some of the model was created without memory and not made yet."""
        return any(deferred.is_deferred(t) for t in self._all_tensors())

    def _all_tensors(self) -> list[torch.Tensor]:
        return [t for _, t, _ in self._state_tensors(local_only=False, persistent_only=False)]

    def _sync_random_states(self, root: nn.Module | None = None) -> None:
        """A delayed model's share will be made from rank 0's random states, on every rank
        (``root``: the module before it is wrapped)."""
        tensors = self._all_tensors() if root is None else [*root.parameters(), *root.buffers()]
        recordings = deferred.recordings_of(tensors)
        if recordings and self._state.size > 1:
            deferred.sync_random_states(recordings, self._rank0_states)

    def _partition(self, make_body: Callable[[torch.device], Callable[[int], Any]]) -> None:
        st = self._state
        self._sync_random_states()
        self._broadcast_initial_state(self.module)
        fixed = placement.manual_placements(self.module)
        if st.config["auto_partition"] and st.pp_size > 1:
            plan = self._auto_plan(make_body, fixed)
        else:
            plan = manual_plan(
                self.module,
                st.pp_size,
                fixed=fixed,
                default_partition=st.config.get("default_partition") or 0,
            )
        self._apply_plan(plan)

    def _auto_plan(
        self, make_body: Callable[[torch.device], Callable[[int], Any]], fixed: dict[str, int]
    ) -> PartitionPlan:
        """Rank 0 profiles its first microbatch and plans; every rank gets rank 0's plan.

        The others wait for as long as rank 0 works and shows signs of life
        (:mod:`..pipeline.solo`): profiling a large model, on the CPU above all, may take longer
        than any wait for a peer (``DTRAIN_MP_TIMEOUT``) should. With tensor parallelism rank
        0's tp group profiles with it (its modules' collectives need the whole group), each
        on its own first microbatch, and only rank 0 plans.
        """
        st = self._state
        store, name = default_store(), f"dtrain/mp-plan/{next(_PLANS)}"
        failed: Exception | None = None
        if st.rank == 0:
            try:
                with solo.working(store, name, st.options.timeout):
                    self._profile_with_tp_group(make_body)
                    plan = self._plan_from_profile(fixed)
            except BaseException as exc:
                self._broadcast_objects([("error", error_body(0, exc))])
                raise
            payload: list[Any] = [("plan", plan.to_dict())]
        else:
            if st.rank in st.topology.group("tp", 0):
                try:
                    self._profile_with_tp_group(make_body)
                except Exception as exc:  # rank 0 broadcasts it: the other ranks wait for that
                    failed = exc
            what = "rank 0 to profile the model and plan its partition"
            solo.wait_for(store, name, st.options.timeout, st.rank, what)
            payload = [None]
        kind, value = self._broadcast_objects(payload)[0]
        if failed is not None:
            raise failed
        if kind == "error":
            raise StepFailedError(value.rank, value.exc_type, value.message, value.remote_traceback)
        return PartitionPlan.from_dict(value)

    def _profile_with_tp_group(
        self, make_body: Callable[[torch.device], Callable[[int], Any]]
    ) -> None:
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

    def _traced_step(self, make_body: Callable[[torch.device], Callable[[int], Any]]) -> None:
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
        placed = nullcontext() if self._delayed() else moved_to(self.module, device)
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
        if self._profile is None:
            raise ModelParallelError(
                "the step function did not call the model, so it cannot be partitioned"
            )
        if self._plan_ordered():  # with the root's code on partition 0, and its parent
            pinned = {name for pair in with_own_code(self.module).items() for name in pair}
            fixed = {**dict.fromkeys(pinned - {""}, 0), **fixed}
        whole = activations.kept_whole(self.module)
        if self.tensor_shards is not None:
            whole |= self.tensor_shards.split_blocks(self.module)
        while True:
            plan = auto_plan(
                self._profile,
                st.pp_size,
                memory_weight=st.config["memory_weight"],
                fixed=fixed,
                whole=whole,
            )
            returning = self._returning(plan) if self._plan_ordered() else None
            if returning is None or returning in whole:
                break
            whole.add(returning)  # planned again with it whole, on one partition
        return fit.check_device_memory(plan, self._profile, st, self.module, fixed, whole)

    def _returning(self, plan: PartitionPlan) -> str | None:
        """Where the plan's route is one no plan order serves, a module whose code, on one
        partition, runs again after its submodules on a later one returned (its end), before
        the route goes on: kept whole, it takes them back (``None``: no such module)."""
        events = self._route_events(plan)
        try:
            check_route(route_of((plan.owner(name), 0.0) for name, _ in events)[0])
        except ValueError:
            for (before, _), (name, end) in itertools.pairwise(events):
                if end and plan.owner(name) < plan.owner(before):
                    return name
        return None

    @staticmethod
    def _seconds(plan: PartitionPlan, name: str) -> float:
        return plan.modules[name].compute_time if plan.profiled else 0.0

    def _route_events(self, plan: PartitionPlan) -> list[tuple[str, bool]]:
        """The modules the forward enters and leaves, in order, as ``(name, is_end)``: from a
        profiled plan, in the order of their first calls, each left before the next module
        outside it is entered (the root is never left: the step ends there); from a plan made
        without running the model, entered in the order they are registered."""
        names = [name for name, _ in self.module.named_modules()]
        if not plan.profiled:
            return [(name, False) for name in names]
        called = {name: plan.modules[name].order for name in names if name in plan.modules}
        events: list[tuple[str, bool]] = []
        open_: list[str] = []
        ran = sorted((n for n in names if called.get(n) is not None), key=called.__getitem__)
        for name in ran:
            while open_ and open_[-1] and not name.startswith(f"{open_[-1]}."):
                events.append((open_.pop(), True))
            events.append((name, False))
            open_.append(name)
        events.extend((name, True) for name in reversed(open_) if name)
        return events

    def _broadcast_objects(self, payload: list[Any]) -> list[Any]:
        """Rank 0's ``payload``, on every rank."""
        st = self._state
        return broadcast_object(payload, 0, st.object_groups["world"], st.seals)

    def _rank0_states(self, states: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rank 0's saved generator states of a delayed model, on every rank."""
        theirs = self._broadcast_objects([state.numpy().tobytes() for state in states])
        return [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in theirs]

    def _broadcast_initial_state(self, root: nn.Module) -> None:
        """Every rank starts from rank 0's parameters and buffers of ``root`` (models may be
        seeded apart), once: a model with tensor parallelism when wrapped, before its modules
        are split (each rank cuts its shards from these values), any other at its first step (a
        sharded one as it is sharded). A tensor created without memory is made from rank 0's
        random states instead, and a DTensor then is an ``smp.nn`` module's, created alike on
        every rank (``tensor_parallel_seed``)."""
        st = self._state
        if st.size == 1 or self._from_rank_zero:
            return
        self._from_rank_zero = True
        with torch.no_grad():
            for tensor in [*root.parameters(), *root.buffers()]:
                if tensor.is_meta or is_traceable_wrapper_subclass(tensor):
                    continue
                data = tensor.data.to(st.device)
                dist.broadcast(data, src=0, group=st.world_process_group)
                if data is not tensor.data:
                    tensor.data.copy_(data)

    def _check_own_code(self, plan: PartitionPlan) -> None:
        if self._plan_ordered():
            check_own_code_placement(self.module, plan.owner)

    def _apply_plan(self, plan: PartitionPlan) -> None:
        st = self._state
        self._check_own_code(plan)
        if self.tensor_shards is not None:
            self.tensor_shards.check_partition(self.module, plan.owner)
        modules = dict(self.module.named_modules())
        self._plan = plan
        owners = {name: plan.owner(name) for name in modules}
        self._local_modules = {id(m) for name, m in modules.items() if owners[name] == st.pp_rank}
        for name, module in modules.items():
            if owners[name] != st.pp_rank:
                hooks.drop_local_hooks(module)
        mine = [t for _, t, _ in self._state_tensors(local_only=True, persistent_only=False)]
        local = {id(t) for t in mine}
        with torch.no_grad():
            deferred.materialize(mine, st.device)
            for tensor in self._all_tensors():
                if id(tensor) in local:
                    tensor.data = tensor.data.to(st.device)
                else:  # another rank owns it: free the memory, keep the object
                    deferred.empty_in_place(tensor, st.device)
        self._cast_to_half()
        group = PipelineGroup(
            rank=st.rank,
            pp_rank=st.pp_rank,
            ranks=list(st.pp_group),
            message_group=st.pp_message_group,
            device=st.device,
            timeout=st.options.timeout,
        )
        self._schedule = self._planned_schedule(plan)
        ordering = ordering_for(self._schedule, st.pp_rank, self._plan_ordered())
        self._runtime = PipelineRuntime(
            group, modules, owners, self._schedule.policy, st.options, ordering
        )
        if st.pp_size > 1:
            dist.barrier(group=st.pp_message_group)
        for sd, strict, full in self._pending_loads:
            self._load_local(sd, strict, full=full)
        self._pending_loads.clear()
        self._run_post_partition_hooks()

    def _run_post_partition_hooks(self) -> None:
        for hook in list(self._post_partition_hooks.values()):
            hook(self)

    def _cast_to_half(self) -> None:
        """With ``fp16``/``bf16``: this rank's parameters get fp32 masters and the model's
        floating parameters and buffers become half; call once the own ones are in place."""
        if self.half_precision is not None:
            self.half_precision.cast(self.local_parameters(), self._all_tensors())

    def _restore_marks(self) -> None:
        """Which parameters' gradients average over which group (see
        :data:`.tensor.shards.SCALED_NAMES`), put back at every step: a conversion of the model
        or of its inner module (``to``, ``cuda``, ``half``, the half cast) swaps them away."""
        if self.tensor_shards is not None:
            self.tensor_shards.restore_marks(self.module)

    def _plan_ordered(self) -> bool:
        """Whether every rank computes in its plan row's order: with ``deterministic_server``,
        and where a tp group's ranks must run their collectives in one order."""
        return bool(self._state.config["deterministic_server"]) or self._state.tp_size > 1

    def _planned_schedule(self, plan: PartitionPlan) -> Schedule | RouteSchedule:
        """The pipeline's policy (which backwards are split chosen for the plan's stage
        times) and the action lists it runs with those times (see :func:`pipeline_plan`)."""
        st = self._state
        policy = SchedulePolicy.for_config(
            st.config["pipeline"], st.config["microbatches"], st.config["active_microbatches"]
        )
        times = [stage.compute_time for stage in plan.stages] if plan.profiled else []
        modules = [
            (plan.owner(name), 0.0 if end else self._seconds(plan, name))
            for name, end in self._route_events(plan)
        ]
        owners = {name: plan.owner(name) for name, _ in self.module.named_modules()}
        return pipeline_plan(
            policy,
            times or [0.0] * st.pp_size,
            modules,
            self._plan_ordered(),
            # their backwards recompute, so they run whole; the other partitions still split
            activations.checkpointing_partitions(self.module, owners),
        )

    def pipeline_schedule(self) -> Schedule | RouteSchedule:
        """The action lists each pipeline rank runs in a step, as planned for the partition
        plan's stage times (printable: ``print(model.pipeline_schedule())``); known after the
        first step."""
        self.partition_plan()  # raises before the first step
        return self._schedule

    def partition_plan(self) -> PartitionPlan:
        """Module → partition with costs; known after the first step."""
        if self._plan is None:
            raise ModelParallelError(
                "the model is partitioned at the first step: call the step function first"
            )
        return self._plan

    def register_post_partition_hook(
        self, hook: Callable[[DistributedModel], None]
    ) -> RemovableHandle:
        handle = RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        return handle

    def get_module(self) -> nn.Module:
        return self.module

    # --- this rank's share -------------------------------------------------------------------

    def _owns(self, module: nn.Module) -> bool:
        return self._local_modules is None or id(module) in self._local_modules

    def _state_tensors(
        self, local_only: bool, persistent_only: bool = True
    ) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """``(name, tensor, is_parameter)`` under every name ``state_dict()`` uses (a tied
        parameter appears under each of its names)."""
        keep = self._owns if local_only else None
        yield from translated.named_state(self.module, persistent_only, keep)

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        for name, tensor, is_param in self._state_tensors(local_only=True):
            if is_param and id(tensor) not in seen:
                seen.add(id(tensor))
                yield name, tensor  # type: ignore[misc]

    def local_parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.local_named_parameters():
            yield param

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for name, tensor, is_param in self._state_tensors(local_only=True, persistent_only=False):
            if not is_param and id(tensor) not in seen:
                seen.add(id(tensor))
                yield name, tensor

    def local_buffers(self) -> Iterator[torch.Tensor]:
        for _, buffer in self.local_named_buffers():
            yield buffer

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        for name, module in self.module.named_modules():
            if self._owns(module):
                yield name, module

    def local_modules(self) -> Iterator[nn.Module]:
        for _, module in self.local_named_modules():
            yield module

    # --- gradients over the data-parallel group ----------------------------------------------

    def _reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Average the gradients of ``params`` (this rank's, or their fp32 masters) over the
        data-parallel group, in the balanced buckets of :mod:`dtrain.dataparallel.buckets`."""
        st = self._state
        if st.dp_size == 1:
            return
        params = [p for p in params if p.requires_grad]
        if not params:
            return
        has_grad = torch.tensor([float(p.grad is not None) for p in params], device=st.device)
        dist.all_reduce(has_grad, group=st.dp_process_group)
        for param, count in zip(params, has_grad.tolist(), strict=True):
            if count > 0 and param.grad is None:
                param.grad = torch.zeros_like(param)
        groups = [(st.dp_process_group, None, [p.grad for p in params if p.grad is not None])]
        if self.tensor_shards is not None:
            groups = self.tensor_shards.gradient_groups(params, st)
        for group, divisor, grads in groups:
            plan = plan_buckets(
                [g.numel() * g.element_size() for g in grads],
                list(range(len(grads))),
                int(self.bucket_cap_mb * 1024 * 1024),
                [(g.dtype, g.device) for g in grads],
            )
            for bucket in plan.buckets:
                average_in_place([grads[index] for index in bucket.params], group, divisor)

    # --- state dicts -------------------------------------------------------------------------

    def local_state_dict(self, cast_to_cpu: bool = True) -> dict[str, Any]:
        """This rank's parameters (its shards of them, when sharded) and persistent buffers, by
        their names in the full model."""
        partial = {PARTIAL_KEY: True, DEGREES_KEY: degrees(self._state)}
        if self.sharding is not None:
            return {**self.sharding.local_state_dict(cast_to_cpu), **partial}
        result: dict[str, Any] = {
            name: (t.cpu() if cast_to_cpu else t) for name, t in self._tensor_values(whole=False)
        }
        return {**result, **partial}

    def state_dict(  # type: ignore[override]
        self,
        *args: Any,
        cast_to_cpu: bool = True,
        gather_to_rank0: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The full model's state, gathered from the pipeline; every pipeline rank must call it."""
        del args, kwargs, gather_to_rank0  # every pipeline rank gets the whole dict
        if self.sharding is not None:
            return self.sharding.full_state_dict()
        # Every rank of a tp group gathers its whole tensors, then the pipeline its partitions.
        local = {name: t.cpu() for name, t in self._tensor_values(whole=True)}
        st = self._state
        if self._runtime is None or st.pp_size == 1:
            return local
        parts = all_gather_objects(local, st.pp_message_group, st.seals)
        full: dict[str, Any] = {}
        for part in parts:
            assert part is not None
            full.update(part)
        order = [name for name, _, _ in self._state_tensors(local_only=False)]
        return {name: full[name] for name in order if name in full}

    def _tensor_values(self, whole: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's persistent tensors by name, detached: the whole value of a tensor split
        over the tp group (``whole``, a gather) or this rank's part of it."""
        for name, tensor, _ in self._state_tensors(local_only=True):
            value = tensor.detach()
            shards = self.tensor_shards
            if shards is not None:
                value = shards.whole(value) if whole else shards.local(value)
            yield name, value

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], strict: bool = True
    ) -> Any:
        """Load a full or a partial (``local_state_dict``) state; before the first step a
        partial one is kept and applied once this rank knows its share. A full one may name a
        translated module's keys as its HF original does (SMP's fine-tuning from HF weights)."""
        partial = bool(state_dict.get(PARTIAL_KEY, False))
        if partial and DEGREES_KEY in state_dict:
            check_degrees(state_dict[DEGREES_KEY], self._state, "load_state_dict")
        values = {k: v for k, v in state_dict.items() if k not in (PARTIAL_KEY, DEGREES_KEY)}
        if not partial:  # a model translated from HF takes its original's names too, as SMP's
            values = translated.from_hf(self.module, values)
        if self.sharding is not None:
            self.sharding.load(values, partial, strict)
            return None
        if self._runtime is None:
            if partial or self._delayed():  # nothing to load into yet
                self._pending_loads.append((values, strict, not partial))
                return None
            return self.module.load_state_dict(values, strict=strict)
        self._load_local(values, strict and not partial, full=not partial)
        return None

    def _load_local(self, values: dict[str, Any], strict: bool, full: bool = False) -> None:
        mine = {name: t for name, t, _ in self._state_tensors(local_only=True)}
        if strict:
            missing = sorted(set(mine) - set(values))
            known = {name for name, _, _ in self._state_tensors(local_only=False)}
            unexpected = sorted(set(values) - known) if full else []
            if missing or unexpected:
                raise ModelParallelError(
                    f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
                )
        half = self.half_precision
        with torch.no_grad():
            for name, tensor in mine.items():
                if name not in values:
                    continue
                master = tensor if half is None else half.master(tensor)
                # A half model's master takes the value unrounded.
                for target in [tensor] if master is tensor else [tensor, master]:
                    if self.tensor_shards is not None:
                        self.tensor_shards.load_into(target, values[name], whole_value=full)
                    else:
                        target.copy_(values[name])

    # --- timeline ----------------------------------------------------------------------------

    def timeline(self, communication: bool = False) -> list[TimelineEvent]:
        """What this rank computed in the last step (pp rank as the row); with
        ``communication``, also its sends, receives and waits for replies."""
        if self._runtime is None:
            return []
        return self._runtime.timeline(communication)

    def export_timeline(self, path: str) -> None:
        """Chrome trace JSON of the last step of the whole pipeline, computations and
        communication; every pipeline rank calls it, the leader writes the file."""
        st = self._state
        events = self.timeline(communication=True)
        if st.pp_size > 1:
            parts = all_gather_objects(events, st.pp_message_group, st.seals)
            events = [event for part in parts for event in (part or [])]
        if st.pp_rank == 0:
            write_chrome_trace(events, path)

    def close(self) -> None:
        """Stop the pipeline runtime (every rank); the model stays usable for a new one."""
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

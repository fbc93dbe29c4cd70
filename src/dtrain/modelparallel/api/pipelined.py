"""The pipelined engine: a module split across the pipeline, trained one step at a time.

Nothing happens to the module until the first step: then every rank takes rank 0's parameters
and buffers, the model is partitioned (:mod:`.partitioning`: rank 0 profiles the first
microbatch and plans, or the manual placement is used), each rank frees the parameters it does
not own, and the pipeline runtime starts. A model created inside
``smp.delay_param_initialization()`` has no memory until then: rank 0 plans from its shapes and
operation counts, and each rank makes only what it owns (:mod:`..deferred`), so no rank ever
holds the whole model. After each step each rank averages its own parameters' gradients over
its data-parallel group (:func:`..tensor.averages.averages`). With ``fp16``/``bf16`` the model
is half and the optimizer steps fp32 masters (:class:`.precision.HalfParameters`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.dataparallel.buckets import plan_buckets
from dtrain.modelparallel import deferred
from dtrain.modelparallel.api import initial
from dtrain.modelparallel.api.engine import MakeBody
from dtrain.modelparallel.api.partitioning import (
    Partitioner,
    check_own_code_placement,
    delayed,
    plan_ordered,
    planned_schedule,
)
from dtrain.modelparallel.api.precision import (
    HalfParameters,
    average_in_place,
    clip_gradients,
    half_dtype,
)
from dtrain.modelparallel.api.state_dicts import check_keys
from dtrain.modelparallel.errors import ModelParallelError, NotInStepError
from dtrain.modelparallel.modules import hooks
from dtrain.modelparallel.modules.tasks import MicrobatchResult
from dtrain.modelparallel.pipeline.group import PipelineGroup
from dtrain.modelparallel.pipeline.runtime import PipelineRuntime
from dtrain.modelparallel.plan.partition import PartitionPlan
from dtrain.modelparallel.scheduling.ordering import ordering_for
from dtrain.modelparallel.scheduling.route import RouteSchedule
from dtrain.modelparallel.scheduling.schedule import Schedule
from dtrain.modelparallel.state import MPState
from dtrain.modelparallel.tensor import averages, dtensors, translated
from dtrain.modelparallel.timeline import TimelineEvent, write_chrome_trace
from dtrain.sealed import all_gather_objects


class PipelinedEngine:
    """The pipeline side of a ``DistributedModel``: partitions the module at the first step,
    runs steps on the pipeline runtime, averages gradients over the data-parallel group, keeps
    a half model's masters, and gathers and splits state dicts by partition."""

    def __init__(
        self,
        module: nn.Module,
        st: MPState,
        trace_device: str,
        bucket_cap_mb: float,
        from_rank_zero: bool,
        partitioned: Callable[[], None],
    ) -> None:
        self.module = module
        self._state = st
        self._bucket_bytes = int(bucket_cap_mb * 1024 * 1024)
        self._from_rank_zero = from_rank_zero
        """Whether every rank holds rank 0's values already (a tensor-parallel model's, from
        when it was wrapped)."""
        self._on_partitioned = partitioned
        """The model's post-partition hooks, run once this rank holds its share."""
        self.partitioner = Partitioner(module, st, trace_device)
        self._runtime: PipelineRuntime | None = None
        self._plan: PartitionPlan | None = None
        self._schedule: Schedule | RouteSchedule | None = None
        self._local_modules: set[int] | None = None
        """ids of the modules this rank owns; ``None`` before partitioning (all of them)."""
        self._pending_loads: list[tuple[dict[str, Any], bool, bool]] = []
        """State dicts loaded before partitioning: ``(values, strict, full)``."""
        dtype = half_dtype(st.config)
        self.half_precision = (
            None if dtype is None else HalfParameters(dtype, st.device, st.world_process_group)
        )
        """``fp16``/``bf16``: the half model's fp32 masters and loss scale (:mod:`.precision`)."""

    @property
    def loss_scaling(self) -> HalfParameters | None:
        return self.half_precision

    @property
    def partitioned(self) -> bool:
        return self._runtime is not None

    @property
    def forwards_set_up(self) -> bool:
        return self._runtime is not None

    # --- calling the model -------------------------------------------------------------------

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.partitioner.tracing:
            return self.partitioner.forward(args, kwargs)
        self._require_step("the model")
        half = self.half_precision
        if half is None:
            return self.module(*args, **kwargs)
        args, kwargs = half.inputs((args, kwargs))
        return half.outputs(self.module(*args, **kwargs))

    def backward(
        self, outputs: list[torch.Tensor], grads: list[torch.Tensor | None], scale: float | None
    ) -> None:
        """A loss another partition computed and nobody fetched yet is fetched with its
        backward, in one request to its owner."""
        if self.partitioner.tracing:
            return
        self._require_step("model.backward").backward(outputs, grads, scale)

    def _require_step(self, what: str) -> PipelineRuntime:
        runtime = self._runtime
        if runtime is None or not runtime.in_step():
            raise NotInStepError.used(what)
        return runtime

    # --- steps -------------------------------------------------------------------------------

    def run_step(self, count: int, make_body: MakeBody) -> list[MicrobatchResult]:
        """Partition if needed, run the step body on the leader, reduce gradients."""
        st = self._state
        self._restore_marks()  # before the masters copy them, and the averages read them
        if self._runtime is None:
            self._apply_plan(self._partition(make_body))
        runtime = self._runtime
        assert runtime is not None
        # the gradients averaged below: this rank's, or their fp32 masters (which hold the
        # earlier steps' when accumulating before one optimizer step)
        half = self.half_precision
        params = self.local_parameters() if half is None else half.masters()
        averages.carry_earlier(params, st)
        if runtime.is_leader:
            try:
                body = make_body(st.device)
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
            if st.options.trace and st.dp_rank == 0:  # every rank of the first pipeline
                self.export_timeline(st.options.trace)
        return outcomes

    def _restore_marks(self) -> None:
        """Which parameters' gradients average over which group (see
        :data:`..tensor.averages.SCALED_NAMES`), put back at every step with tensor
        parallelism: a conversion of the model or of its inner module (``to``, ``cuda``,
        ``half``, the half cast) swaps them away."""
        if self._state.tp_size > 1:
            averages.restore_marks(self.module)

    # --- partitioning ------------------------------------------------------------------------

    def _partition(self, make_body: MakeBody) -> PartitionPlan:
        """Every rank's plan, from rank 0's values (a delayed model's from its random states)."""
        initial.sync_random_states(self._all_tensors(), self._state)
        if not self._from_rank_zero:
            initial.broadcast_values(self.module, self._state)
            self._from_rank_zero = True
        return self.partitioner.plan(make_body)

    def _all_tensors(self) -> list[torch.Tensor]:
        return [t for _, t, _ in translated.named_state(self.module, persistent_only=False)]

    def _apply_plan(self, plan: PartitionPlan) -> None:
        st = self._state
        if plan_ordered(st):
            check_own_code_placement(self.module, plan.owner)
        if st.tp_size > 1:
            from dtrain.modelparallel.tensor import shards  # DTensor: with tp only

            shards.check_partition(self.module, plan.owner)
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
        if self.half_precision is not None:  # the own parameters' masters, then all half
            self.half_precision.cast(self.local_parameters(), self._all_tensors())
        group = PipelineGroup(
            rank=st.rank,
            pp_rank=st.pp_rank,
            ranks=list(st.pp_group),
            message_group=st.pp_message_group,
            device=st.device,
            timeout=st.options.timeout,
        )
        self._schedule = planned_schedule(self.module, plan, st)
        ordering = ordering_for(self._schedule, st.pp_rank, plan_ordered(st))
        self._runtime = PipelineRuntime(
            group, modules, owners, self._schedule.policy, st.options, ordering
        )
        if st.pp_size > 1:
            dist.barrier(group=st.pp_message_group)
        for sd, strict, full in self._pending_loads:
            self._load_local(sd, strict, full=full)
        self._pending_loads.clear()
        self._on_partitioned()

    def pipeline_schedule(self) -> Schedule | RouteSchedule:
        self.partition_plan()  # raises before the first step
        assert self._schedule is not None
        return self._schedule

    def partition_plan(self) -> PartitionPlan:
        if self._plan is None:
            raise ModelParallelError(
                "the model is partitioned at the first step: call the step function first"
            )
        return self._plan

    # --- this rank's share -------------------------------------------------------------------

    def owns(self, module: nn.Module) -> bool:
        return self._local_modules is None or id(module) in self._local_modules

    def _state_tensors(
        self, local_only: bool, persistent_only: bool = True
    ) -> Iterator[tuple[str, torch.Tensor, bool]]:
        keep = self.owns if local_only else None
        yield from translated.named_state(self.module, persistent_only, keep)

    def local_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once."""
        found: dict[int, Any] = {}
        for _, tensor, is_param in self._state_tensors(local_only=True):
            if is_param:
                found.setdefault(id(tensor), tensor)
        return list(found.values())

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
        for average in averages.averages(params, st, rdp_mean_taken=False):
            grads = average.grads
            plan = plan_buckets(
                [g.numel() * g.element_size() for g in grads],
                list(range(len(grads))),
                self._bucket_bytes,
                [(g.dtype, g.device) for g in grads],
            )
            for bucket in plan.buckets:
                chosen = [grads[index] for index in bucket.params]
                average_in_place(chosen, average.group, average.divisor)

    # --- state dicts -------------------------------------------------------------------------

    def local_state_dict(self, cast_to_cpu: bool) -> dict[str, Any]:
        return {
            name: (t.cpu() if cast_to_cpu else t) for name, t in self._tensor_values(whole=False)
        }

    def state_dict(self) -> dict[str, Any]:
        """The full model's state, gathered from the pipeline; every pipeline rank must call
        it: every rank of a tp group gathers its whole tensors, then the pipeline its
        partitions."""
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
            yield name, dtensors.whole(value) if whole else dtensors.local(value)

    def load_state_dict(self, values: dict[str, Any], partial: bool, strict: bool) -> Any:
        """Before the first step a partial state (or any, for a model created without
        memory) is kept and applied once this rank knows its share."""
        if self._runtime is None:
            if partial or delayed(self.module):  # nothing to load into yet
                self._pending_loads.append((values, strict, not partial))
                return None
            return self.module.load_state_dict(values, strict=strict)
        self._load_local(values, strict and not partial, full=not partial)
        return None

    def _load_local(self, values: dict[str, Any], strict: bool, full: bool = False) -> None:
        mine = {name: t for name, t, _ in self._state_tensors(local_only=True)}
        if strict:
            known = [name for name, _, _ in self._state_tensors(local_only=False)]
            check_keys(values, mine, known if full else values)
        half = self.half_precision
        with torch.no_grad():
            for name, tensor in mine.items():
                if name not in values:
                    continue
                master = tensor if half is None else half.master(tensor)
                # A half model's master takes the value unrounded.
                for target in [tensor] if master is tensor else [tensor, master]:
                    what = f"load_state_dict: {name!r}"
                    dtensors.load_into(what, target, values[name], whole_value=full)

    # --- what the optimizer steps ------------------------------------------------------------

    def master(self, param: nn.Parameter) -> torch.Tensor:
        half = self.half_precision
        return param if half is None else half.master(param)

    def adapt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: SMP's pipelined optimizer adds only what ``smp.DistributedOptimizer``
        adds."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any:
        """The step on the parameters, or on a half model's masters, which are rounded back
        into the model; skipped on every rank after an fp16 overflow."""
        half = self.half_precision
        return step() if half is None else half.step(step)

    def zero_grad(self) -> None:
        if self.half_precision is not None:
            self.half_precision.zero_grad()

    def clip_master_grads(self, max_norm: float, norm_type: float) -> float:
        """The gradients the optimizer steps (an fp32 model's own, a half model's masters')
        clipped to a global norm over every partition, a tensor-parallel parameter's norm its
        whole one's."""
        st = self._state
        group = st.pp_process_group if st.pp_size > 1 else None
        half = self.half_precision
        if half is None:
            return clip_gradients(self.local_parameters(), max_norm, norm_type, group, st.device)
        return half.clip_master_grads(max_norm, norm_type, group)

    # --- timeline ----------------------------------------------------------------------------

    def timeline(self, communication: bool) -> list[TimelineEvent]:
        if self._runtime is None:
            return []
        return self._runtime.timeline(communication)

    def export_timeline(self, path: str) -> None:
        st = self._state
        events = self.timeline(communication=True)
        if st.pp_size > 1:
            parts = all_gather_objects(events, st.pp_message_group, st.seals)
            events = [event for part in parts for event in (part or [])]
        if st.pp_rank == 0:
            write_chrome_trace(events, path)

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

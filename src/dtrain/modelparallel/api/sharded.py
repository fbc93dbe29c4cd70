"""Sharded data parallelism (``sharded_data_parallel_degree`` > 1) on PyTorch FSDP2.

SMP v1 shards parameters, gradients and optimizer state MiCS-style: over groups of
``sharded_data_parallel_degree`` data-parallel ranks, replicated across the groups. That is
``torch.distributed.fsdp.fully_shard`` over the mesh ``smp.init`` built
(``MPState.sharding_mesh``): 1-D when the degree is the data-parallel degree (FSDP), 2-D
otherwise (HSDP: reduce-scatter within the group, all-reduce across groups).

The module is sharded when ``smp.DistributedModel`` wraps it (SMP's pipeline-less path also
synchronised the parameters at wrap time), so the optimizer the script then creates from
``model.parameters()`` holds the sharded parameters (DTensors) and allocates state for this
rank's shards only.

**Units.** ``fully_shard`` is applied bottom-up to the submodules :func:`shard_units` chooses
(Hugging Face blocks, submodules of at least ``sdp_param_persistence_threshold`` parameters),
then to the root, which keeps the rest; a unit's parameters are gathered together before its
forward (and again before its backward) and freed after.

**Steps.** The step body runs once per microbatch on every rank, one microbatch after the
other: FSDP2 tracks one forward and backward at a time. Each microbatch's backward
reduce-scatters its gradients into the sharded ones, so the step ends with them averaged over
the data-parallel group and averaged (or summed) over microbatches, as pipelines do. A
failure on one rank leaves the others waiting in a collective until the process group's
timeout (``DTRAIN_MP_TIMEOUT``).

**Tensor parallelism.** With ``tensor_parallel_degree`` above 1 the tp group's DTensors
(split when the model is wrapped, on ``MPState.tensor_mesh``, which ``smp.init`` slices from
the same mesh as the sharding one, as FSDP2 requires) are sharded again over the shard group:
each rank holds its shard of its tp slice. Gradients are completed to tensor parallelism's
averages after each step, by the pipelines' rule (:func:`.tensor.averages.averages`).

**Activation checkpointing.** ``smp.set_activation_checkpointing``'s marks, made before or
after wrapping, are applied at the first step (:meth:`ShardedEngine._checkpoint_marked`): a
marked module's forward runs under torch's non-reentrant checkpoint inside its FSDP2 hooks.

**fp16 and bf16.** SMP's half-precision model (:mod:`.precision`: half parameters and buffers,
inputs entering in half, outputs leaving in fp32, fp32 masters stepped by the optimizer) is
FSDP2's mixed precision (:func:`mixed_precision`): the sharded parameters stay fp32 and are the
masters, so the optimizer, clipping and state dicts see fp32 shards and no second copy is
kept; each unit gathers them in half to compute and reduce-scatters its gradients in fp32.
Floating buffers, which FSDP2 leaves alone, become half as the unit is made. fp16 scales the
loss (``model.backward``) by the optimizer's loss scaler, so the sharded fp32 gradients hold
scaled values, summed over microbatches and steps under one scale; ``optimizer.step()`` (or
``optimizer.clip_master_grads`` before it; a step body after that scales them back first)
unscales them and checks them for inf/NaN
(:meth:`ShardedEngine.optimizer_step`), and an overflow on any rank skips the step on every rank and
backs the scale off (:class:`.precision.LossScaling`). Only the check is torch's
(``GradScaler``'s kernel): SMP's dynamic scale has Megatron's hysteresis and minimum, which
``torch.amp.GradScaler`` lacks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dtrain.modelparallel import deferred
from dtrain.modelparallel.api import deepspeed_names, initial
from dtrain.modelparallel.api.engine import MakeBody
from dtrain.modelparallel.api.precision import (
    HalfParameters,
    LossScaling,
    average_in_place,
    clip_gradients,
    convert,
    half_dtype,
    overflowed,
)
from dtrain.modelparallel.api.state_dicts import PIECES_KEY, check_keys
from dtrain.modelparallel.errors import ModelParallelError, NotInStepError
from dtrain.modelparallel.modules import activations
from dtrain.modelparallel.modules.backward import scaled_grads
from dtrain.modelparallel.modules.stubs import install_stub
from dtrain.modelparallel.modules.tasks import MicrobatchResult
from dtrain.modelparallel.plan.partition import PartitionPlan
from dtrain.modelparallel.scheduling.route import RouteSchedule
from dtrain.modelparallel.scheduling.schedule import Schedule
from dtrain.modelparallel.state import MPState
from dtrain.modelparallel.tensor import averages, dtensors, translated
from dtrain.modelparallel.timeline import TimelineEvent, write_chrome_trace

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def shard_units(root: nn.Module, threshold: int) -> list[nn.Module]:
    """The submodules that become FSDP2 units, each before any unit containing it.

    A submodule is a unit when at least ``threshold`` of its parameters lie outside the units
    below it. Hugging Face blocks (``root._no_split_modules``) and torch.nn's own modules
    other than containers are atomic: a unit whole, or none of their submodules is one
    (``MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``, so that
    unit's parameters would never be gathered); a block is a unit whatever its size. Never
    a unit: a module that is not called (``ModuleList``, ``ModuleDict``: FSDP2 gathers a
    unit's parameters around its forward) or that shares a parameter with a module outside
    its subtree (FSDP2 must manage a shared parameter in one unit).
    """
    blocks = set(getattr(root, "_no_split_modules", None) or ())
    holders: dict[int, list[str]] = {}
    for prefix, module in root.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append(prefix)

    def self_contained(prefix: str, module: nn.Module) -> bool:
        inside = (prefix, f"{prefix}.")
        return all(
            holder == prefix or holder.startswith(inside[1])
            for param in module.parameters()
            for holder in holders[id(param)]
        )

    units: list[nn.Module] = []

    def visit(prefix: str, module: nn.Module) -> int:
        """Parameters (elements) of ``module`` outside the units found below it."""
        block = type(module).__name__ in blocks
        atomic = block or (
            type(module).__module__.startswith("torch.nn.") and not isinstance(module, CONTAINERS)
        )
        if atomic:
            loose = sum(p.numel() for p in module.parameters())
        else:
            loose = sum(p.numel() for p in module.parameters(recurse=False))
            for name, child in module.named_children():
                loose += visit(f"{prefix}.{name}" if prefix else name, child)
        if (
            module is not root
            and loose > 0
            and (block or loose >= threshold)
            and type(module).forward is not nn.Module.forward
            and self_contained(prefix, module)
        ):
            units.append(module)
            return 0
        return loose

    visit("", root)
    return units


def mixed_precision(dtype: torch.dtype | None, root: bool) -> MixedPrecisionPolicy:
    """FSDP2's policy for a unit of a model in ``dtype`` (``None``: fp32, no casts): parameters
    gathered in ``dtype`` from their fp32 shards, gradients reduced (and accumulated over
    microbatches) in fp32, floating inputs cast to ``dtype`` where each unit is entered (the
    root's are the model's; deeper ones are activations in ``dtype`` already) and, at the
    ``root``, the model's floating outputs cast to fp32, as SMP's Bit16 module does."""
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=dtype,
        reduce_dtype=torch.float32,
        output_dtype=torch.float32 if root else None,
        cast_forward_inputs=True,
    )


class ShardedEngine:
    """The sharded side of a ``DistributedModel``: shards the module when it is wrapped, runs
    steps, clips gradients and converts state dicts between full, partial and sharded."""

    half_precision: HalfParameters | None = None
    """The fp32 shards are the masters: none kept apart."""

    def __init__(
        self,
        module: nn.Module,
        st: MPState,
        from_rank_zero: bool,
        partitioned: Callable[[], None],
    ) -> None:
        mesh = st.sharding_mesh
        assert mesh is not None, "smp.init builds the mesh when the degree is above 1"
        self.module = module
        self._state = st
        self.device = st.device
        self._from_rank_zero = from_rank_zero
        """Whether every rank holds rank 0's values already (broadcast when a tensor-parallel
        model was wrapped, before its modules were split): :meth:`_prepare` broadcasts none."""
        self._on_partitioned = partitioned
        """The model's post-partition hooks, run before the first step (it is sharded now)."""
        self._mesh = mesh
        self.max_grad_norm = float(st.config["sdp_gradient_clipping"])
        self._world = st.world_process_group
        self._stepping = False
        self._unscaled = False
        """Whether this optimizer step's gradients are unscaled already (fp16)."""
        self._measured: float | None = None
        """This optimizer step's gradient norm, if ``clip_master_grads`` measured it."""
        self.grad_norm = 0.0
        """The global norm over every shard of the unscaled gradients the last optimizer step
        took, before clipping (DeepSpeed's ``_global_grad_norm``, which SMP's sharded
        optimizer exposes); a skipped step leaves it."""
        self.stepped = False
        """Whether a step has begun (the post-partition hooks have run then)."""
        self.dtype = half_dtype(st.config)
        """The compute dtype of ``fp16``/``bf16``; ``None``: fp32."""
        self._scaling = LossScaling(self.dtype) if self.dtype == torch.float16 else None
        """fp16's loss scale and overflow flag (``smp.DistributedOptimizer`` sets the scaler);
        bf16 and fp32 scale nothing."""
        initial.sync_random_states([*module.parameters(), *module.buffers()], st)
        claimed: set[int] = set()
        for unit in shard_units(module, st.config["sdp_param_persistence_threshold"]):
            self._shard(unit, claimed, mixed_precision(self.dtype, root=False))
        self._shard(module, claimed, mixed_precision(self.dtype, root=True))
        averages.restore_marks(module)  # onto FSDP2's shards: they lose the parameters' marks
        self._params = list(module.parameters())
        """Every sharded parameter: FSDP2 leaves their gradients the mean over the rdp ranks."""
        deepspeed_names.mark_shards(self._params)

    @property
    def loss_scaling(self) -> LossScaling | None:
        return self._scaling

    @property
    def partitioned(self) -> bool:
        return True

    @property
    def forwards_set_up(self) -> bool:
        return self.stepped

    def owns(self, module: nn.Module) -> bool:
        """Every rank holds its shards of every module."""
        return True

    def _shard(self, unit: nn.Module, claimed: set[int], policy: MixedPrecisionPolicy) -> None:
        """Make ``unit``'s tensors outside the units sharded before it (``claimed``) and shard
        it."""
        managed = [m for m in unit.modules() if id(m) not in claimed]
        claimed.update(id(m) for m in managed)
        self._prepare(managed)
        fully_shard(unit, mesh=self._mesh, mp_policy=policy)

    def _prepare(self, modules: list[nn.Module]) -> None:
        """Make the tensors one unit manages (the parameters and buffers of ``modules``, the
        unit's submodules outside the units below it) rank 0's on every rank (broadcast, unless
        a tensor-parallel model's were when it was wrapped), on this rank's device, right before
        the unit is sharded.

        This is the one place a unit's tensors exist whole: a model created without memory
        (``smp.delay_param_initialization``) is made here, unit by unit, with its eager values
        (:mod:`..deferred`, from rank 0's random states), so that no rank ever holds more than
        one unsharded unit beside the shards.
        """
        tensors = [
            (tensor, table is module._buffers)
            for module in modules
            for table in (module._parameters, module._buffers)
            for tensor in table.values()
            if tensor is not None
        ]
        with torch.no_grad():
            deferred.materialize([t for t, _ in tensors if not isinstance(t, DTensor)], self.device)
            for tensor, is_buffer in tensors:
                if isinstance(tensor, DTensor):  # the tp group's shards (made when wrapped)
                    kept = self._kept(tensor, is_buffer)
                    if kept.dtype != tensor.dtype:
                        convert(tensor, kept.dtype)
                    continue
                data = tensor.data.to(self.device)
                if not self._from_rank_zero:
                    dist.broadcast(data, src=0, group=self._world)
                tensor.data = self._kept(data, is_buffer)

    def _kept(self, data: torch.Tensor, is_buffer: bool) -> torch.Tensor:
        """``data`` in the dtype the model keeps it in: with ``fp16``/``bf16`` a floating
        parameter is fp32 (its master, however the script created it) and a floating buffer
        half, as SMP's Bit16 module keeps them."""
        if self.dtype is None or not data.is_floating_point():
            return data
        return data.to(self.dtype if is_buffer else torch.float32)

    # --- steps -------------------------------------------------------------------------------

    def _require_step(self, what: str) -> None:
        if not self._stepping:
            raise NotInStepError.used(what)

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._require_step("the model")
        return self.module(*args, **kwargs)

    def backward(
        self, outputs: list[torch.Tensor], grads: list[torch.Tensor | None], scale: float | None
    ) -> None:
        self._require_step("model.backward")
        torch.autograd.backward(outputs, scaled_grads(outputs, grads, scale))

    def run_step(self, count: int, make_body: MakeBody) -> list[MicrobatchResult]:
        """The step body for each microbatch in turn, on this rank's device."""
        st = self._state
        if not self.stepped:
            self._on_partitioned()
            self._checkpoint_marked()
        body = make_body(self.device)
        self._rescale()
        self._measured = None  # a norm clip_master_grads took misses this body's gradients
        self.stepped = self._stepping = True
        if st.tp_size > 1:  # put back where a conversion swapped them away
            averages.restore_marks(self.module)
        deepspeed_names.mark_shards(self._params)  # likewise
        averages.carry_earlier(self._params, st)  # FSDP2 adds this step's to them; divided after
        try:
            results: list[MicrobatchResult] = [(True, body(mb)) for mb in range(count)]
            for average in averages.averages(self._params, st, rdp_mean_taken=True):
                average_in_place(average.grads, average.group, average.divisor)
            return results
        except BaseException:
            root = self.module
            assert isinstance(root, FSDPModule)
            root.reset_iter_state()
            raise
        finally:
            self._stepping = False

    def _checkpoint_marked(self) -> None:
        """Checkpoint the modules ``smp.set_activation_checkpointing`` marked (before or after
        wrapping), as the pipeline does on its one partition: a marked module's forward becomes
        its checkpointed forward. That is inside the module's FSDP2 hooks, so a marked unit's
        parameters are gathered around its forward and, in backward, before its recomputation
        (FSDP2's pre-backward hook runs before the gradient reaches the region); a marked
        module holding units recomputes them through their hooks, which gather them again."""
        modules = dict(self.module.named_modules())
        plan = activations.plan_checkpointing(self.module, dict.fromkeys(modules, 0))
        for name, module in modules.items():
            if plan.changes(name):
                install_stub(module, plan.forward_of(name, module))

    # --- what the optimizer steps ------------------------------------------------------------

    def master(self, param: nn.Parameter) -> torch.Tensor:
        return param

    def adapt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """What AWS's sharded scripts read of SMP's sharded (DeepSpeed) optimizer: DeepSpeed's
        names for the shards (:mod:`.deepspeed_names`)."""
        deepspeed_names.expose(optimizer, self._mesh.get_group(self._mesh.ndim - 1))

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any:
        """The optimizer's ``step``, as SMP's sharded optimizer steps: with fp16 the gradients
        are unscaled and checked first (unless ``clip_master_grads`` did it), and an overflow
        on any rank skips the step (returning ``None``) on every rank; then they are clipped
        to ``sdp_gradient_clipping``, their norm before any clipping kept (:attr:`grad_norm`,
        the optimizer's ``_global_grad_norm``)."""

        def clipped() -> Any:
            norm = self.clip_gradients(self.max_grad_norm or math.inf)  # inf: measures only
            self.grad_norm = norm if self._measured is None else self._measured
            return step()

        try:
            if self._scaling is None:
                result = clipped()
            else:
                self._unscale()
                result = self._scaling.step(clipped)
        finally:
            self._unscaled = False
            self._measured = None
        optimizer._global_grad_norm = self.grad_norm  # type: ignore[attr-defined]  # SMP's attribute, read by scripts
        return result

    def clip_master_grads(self, max_norm: float, norm_type: float) -> float:
        """``optimizer.clip_master_grads``: the gradients unscaled first (fp16), then clipped to
        a global norm ``max_norm`` over every shard; returns the norm before clipping, -1 after
        an fp16 overflow on any rank (apex's: the step will be skipped). Every rank calls it,
        between the step function and ``optimizer.step()``, which clips to
        ``sdp_gradient_clipping`` as well."""
        if self._scaling is not None:
            self._unscale()
            if self._scaling.overflow:
                return -1.0
        norm = self.clip_gradients(max_norm, norm_type)
        if self._measured is None and norm_type == 2:
            self._measured = norm
        return norm

    def zero_grad(self) -> None:
        """``optimizer.zero_grad`` dropped the gradients: the next ones are scaled again (and
        not measured yet)."""
        self._unscaled = False
        self._measured = None

    def _rescale(self) -> None:
        """Scale gradients that ``clip_master_grads`` unscaled back up before another step body
        adds scaled ones to them, so that ``optimizer.step()`` unscales the sum once (exact when
        the scale is a power of two, as dynamic ones are; an inf stays inf)."""
        if not self._unscaled:
            return
        assert self._scaling is not None
        grads = [dtensors.local(p.grad) for p in self.module.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self._scaling.loss_scale)
        self._unscaled = False

    def _unscale(self) -> None:
        """Divide the sharded gradients by the loss scale, once per optimizer step, and set
        the overflow flag: whether any rank's hold an inf or a NaN (agreed over the world:
        shards differ, and every rank calls this once whatever it holds)."""
        assert self._scaling is not None
        if self._unscaled:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        inverse = 1.0 / self._scaling.loss_scale
        self._scaling.overflow = bool(overflowed(grads, inverse, self.device, self._world).item())
        self._unscaled = True

    def clip_gradients(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the gradients so that their global norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does in one process; returns the norm before
        clipping. Each DTensor shard's norm is resolved over its mesh (summed over the shard
        group, once: replicas agree)."""
        params = self.module.parameters()
        return clip_gradients(params, max_norm, norm_type, None, self.device)

    # --- state dicts -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state on every rank (gathered: every rank must call it)."""
        options = StateDictOptions(full_state_dict=True)
        full = cast(dict[str, torch.Tensor], get_model_state_dict(self.module, options=options))
        return {name: value.detach().cpu() for name, value in full.items()}

    def _registered(self) -> dict[str, torch.Tensor]:
        """The module's persistent tensors by name, each unit's parameters its shards (as
        DTensors): a forward without backward leaves the root's gathered, which resharding
        undoes, as ``state_dict()``'s FSDP2 pre-hooks would. Not ``module.state_dict()``,
        whose hooks may replace a value: ``smp.nn`` modules' hooks gather a DTensor whole,
        which is then no shard to save and, loaded into, a copy that the parameter never
        sees."""
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return {name: tensor for name, tensor, _ in translated.named_state(self.module)}

    def local_state_dict(self, cast_to_cpu: bool) -> dict[str, Any]:
        """This rank's shards of the parameters (and every buffer), by their full names, and
        where each shard lies in its whole tensor (:data:`.state_dicts.PIECES_KEY`)."""
        result: dict[str, Any] = {}
        pieces = {}
        for name, value in self._registered().items():
            local = dtensors.local(value).detach()
            result[name] = local.cpu() if cast_to_cpu else local
            if dtensors.is_distributed(value):
                pieces[name] = (tuple(value.shape), dtensors.offset(value))
        return {**result, PIECES_KEY: pieces}

    def load_state_dict(self, values: dict[str, Any], partial: bool, strict: bool) -> None:
        """Load a full state dict (every rank keeps its shards of it) or this rank's partial
        one, saved by :meth:`local_state_dict` with the same degrees."""
        mine = self._registered()
        if strict:
            check_keys(values, mine, mine)
        with torch.no_grad():
            for name, tensor in mine.items():
                if name in values:
                    what = f"load_state_dict: {name!r}"
                    dtensors.load_into(what, tensor, values[name], whole_value=not partial)

    # --- the pipeline: none ------------------------------------------------------------------

    def partition_plan(self) -> PartitionPlan:
        raise _no_pipeline("partition_plan")

    def pipeline_schedule(self) -> Schedule | RouteSchedule:
        raise _no_pipeline("pipeline_schedule")

    def timeline(self, communication: bool) -> list[TimelineEvent]:
        """Nothing: the pipeline's timeline records its partitions' work."""
        return []

    def export_timeline(self, path: str) -> None:
        write_chrome_trace(self.timeline(communication=True), path)

    def close(self) -> None:
        """Nothing runs between steps."""


def _no_pipeline(what: str) -> ModelParallelError:
    return ModelParallelError(
        f"model.{what}(): a sharded model (sharded_data_parallel_degree above 1) runs no "
        "pipeline, so it has no partition plan or pipeline schedule"
    )

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
averages after each step (:meth:`ShardedModel._average_over_tp_group`).

**Activation checkpointing.** ``smp.set_activation_checkpointing``'s marks, made before or
after wrapping, are applied at the first step (:meth:`ShardedModel._checkpoint_marked`): a
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
(:meth:`ShardedModel.step`), and an overflow on any rank skips the step on every rank and
backs the scale off (:class:`.precision.LossScaling`). Only the check is torch's
(``GradScaler``'s kernel): SMP's dynamic scale has Megatron's hysteresis and minimum, which
``torch.amp.GradScaler`` lacks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

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
from dtrain.modelparallel.api.precision import (
    LossScaling,
    average_in_place,
    clip_gradients,
    convert,
    half_dtype,
)
from dtrain.modelparallel.errors import ModelParallelError, NotInStepError
from dtrain.modelparallel.modules import activations
from dtrain.modelparallel.modules.stubs import install_stub
from dtrain.modelparallel.modules.tasks import MicrobatchResult
from dtrain.modelparallel.state import MPState
from dtrain.modelparallel.tensor import shards

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


class ShardedModel:
    """The sharded side of a ``DistributedModel``: shards the module, runs steps, clips
    gradients and converts state dicts between full, partial and sharded."""

    def __init__(
        self,
        module: nn.Module,
        st: MPState,
        named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor, bool]]],
        from_rank_zero: bool = False,
    ) -> None:
        mesh = st.sharding_mesh
        assert mesh is not None, "smp.init builds the mesh when the degree is above 1"
        self.module = module
        self._named_tensors = named_tensors
        """The module's persistent parameters and buffers, ``(name, tensor, is_parameter)``
        under every ``state_dict()`` name (``DistributedModel``'s walk of the modules).
        Partial state dicts go by these, not by ``module.state_dict()``, whose hooks may
        replace a value: ``smp.nn`` modules' hooks gather a DTensor whole, which is then no shard
        to save and, loaded into, a copy that the parameter never sees."""
        self.device = st.device
        self._from_rank_zero = from_rank_zero
        """Whether every rank holds rank 0's values already (broadcast when a tensor-parallel
        model was wrapped, before its modules were split): :meth:`_prepare` broadcasts none."""
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
        """Whether a step has begun (``DistributedModel`` runs post-partition hooks before)."""
        self.dtype = half_dtype(st.config)
        """The compute dtype of ``fp16``/``bf16``; ``None``: fp32."""
        self.scaling = LossScaling(self.dtype) if self.dtype == torch.float16 else None
        """fp16's loss scale and overflow flag (``smp.DistributedOptimizer`` sets the scaler);
        bf16 and fp32 scale nothing."""
        self._tensor_group = st.tp_process_group if st.tp_size > 1 else None
        """With tensor parallelism, the tp group, over which :meth:`_average_over_tp_group`
        completes FSDP2's averaging over the rdp ranks."""
        self._tp_batches = shards.tp_batches(st)
        """What a scaled-batch gradient is divided by after FSDP2's mean over the rdp ranks."""
        scaled = {name for name, p in module.named_parameters() if shards.is_scaled_batch(p)}
        claimed: set[int] = set()
        for unit in shard_units(module, st.config["sdp_param_persistence_threshold"]):
            self._shard(unit, claimed, mixed_precision(self.dtype, root=False))
        self._shard(module, claimed, mixed_precision(self.dtype, root=True))
        self._scaled_batch = [(p, name in scaled) for name, p in module.named_parameters()]
        """Every sharded parameter, and whether it saw the tp group's combined batch (a
        parameter of a distributed module: :func:`.tensor.shards.is_scaled_batch`; FSDP2's
        shards lose the mark)."""

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

    def require_step(self, what: str) -> None:
        if not self._stepping:
            raise NotInStepError.used(what)

    def run_step(
        self, count: int, make_body: Callable[[torch.device], Callable[[int], Any]]
    ) -> list[MicrobatchResult]:
        """The step body for each microbatch in turn, on this rank's device."""
        if not self.stepped:
            self._checkpoint_marked()
        body = make_body(self.device)
        self._rescale()
        self._measured = None  # a norm clip_master_grads took misses this body's gradients
        self.stepped = self._stepping = True
        if self._tensor_group is not None:  # FSDP2 adds this step's to them; divided after
            earlier = [p.grad for p, scaled in self._scaled_batch if scaled and p.grad is not None]
            shards.carry_earlier(earlier, self._tp_batches)
        try:
            results: list[MicrobatchResult] = [(True, body(mb)) for mb in range(count)]
            self._average_over_tp_group()
            return results
        except BaseException:
            root = self.module
            assert isinstance(root, FSDPModule)
            root.reset_iter_state()
            raise
        finally:
            self._stepping = False

    def _average_over_tp_group(self) -> None:
        """Complete FSDP2's mean over the rdp ranks to SMP's averages with tensor parallelism
        (those of :func:`.tensor.shards.gradient_groups`): a plain parameter saw its rank's
        batch, so its gradient is the mean over the tp group too (whose ranks shard it alike);
        a distributed module's holds the sum over :func:`.tensor.shards.tp_batches` batches,
        so it is divided by that (the earlier steps' were multiplied by it:
        :func:`.tensor.shards.carry_earlier`)."""
        if self._tensor_group is None:
            return
        plain = [
            _local(p.grad) for p, scaled in self._scaled_batch if not scaled and p.grad is not None
        ]
        if plain:
            average_in_place(plain, self._tensor_group)
        scaled = [_local(p.grad) for p, s in self._scaled_batch if s and p.grad is not None]
        if scaled and self._tp_batches > 1:
            torch._foreach_div_(scaled, self._tp_batches)

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

    def backward(self, outputs: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        self.require_step("model.backward")
        torch.autograd.backward(outputs, grads)

    def step(self, step: Callable[[], Any]) -> Any:
        """The optimizer's ``step``, as SMP's sharded optimizer steps: with fp16 the gradients
        are unscaled and checked first (unless ``clip_master_grads`` did it), and an overflow
        on any rank skips the step (returning ``None``) on every rank; then they are clipped
        to ``sdp_gradient_clipping``, their norm before any clipping kept (:attr:`grad_norm`)."""

        def clipped() -> Any:
            norm = self.clip_gradients(self.max_grad_norm or math.inf)  # inf: measures only
            self.grad_norm = norm if self._measured is None else self._measured
            return step()

        try:
            if self.scaling is None:
                return clipped()
            self._unscale()
            return self.scaling.step(clipped)
        finally:
            self._unscaled = False
            self._measured = None

    def clip_master_grads(self, max_norm: float, norm_type: float) -> float:
        """``optimizer.clip_master_grads``: the gradients unscaled first (fp16), then clipped to
        a global norm ``max_norm`` over every shard; returns the norm before clipping, -1 after
        an fp16 overflow on any rank (apex's: the step will be skipped). Every rank calls it,
        between the step function and ``optimizer.step()``, which clips to
        ``sdp_gradient_clipping`` as well."""
        if self.scaling is not None:
            self._unscale()
            if self.scaling.overflow:
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
        assert self.scaling is not None
        grads = [_local(p.grad) for p in self.module.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self.scaling.loss_scale)
        self._unscaled = False

    def _unscale(self) -> None:
        """Divide the sharded gradients by the loss scale, once per optimizer step, and set
        the overflow flag: whether any rank's hold an inf or a NaN. Each rank checks its shards
        with torch's ``GradScaler`` kernel, then the flag is agreed over the world: shards
        differ, and every rank calls this once whatever it holds."""
        assert self.scaling is not None
        if self._unscaled:
            return
        grads = [_local(p.grad) for p in self.module.parameters() if p.grad is not None]
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            inverse = torch.full_like(found, 1.0 / self.scaling.loss_scale)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self._world)
        self.scaling.overflow = bool(found.item() > 0)
        self._unscaled = True

    def clip_gradients(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the gradients so that their global norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does in one process; returns the norm before
        clipping. Each DTensor shard's norm is resolved over its mesh (summed over the shard
        group, once: replicas agree)."""
        params = self.module.parameters()
        return clip_gradients(params, max_norm, norm_type, None, self.device)

    # --- state dicts -------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state on every rank (gathered: every rank must call it)."""
        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        return {name: value.detach().cpu() for name, value in full.items()}

    def _registered(self) -> dict[str, torch.Tensor]:
        """The module's persistent tensors by name, each unit's parameters its shards (as
        DTensors): a forward without backward leaves the root's gathered, which resharding
        undoes, as ``state_dict()``'s FSDP2 pre-hooks would."""
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return {name: tensor for name, tensor, _ in self._named_tensors()}

    def local_state_dict(self, cast_to_cpu: bool = True) -> dict[str, torch.Tensor]:
        """This rank's shards of the parameters (and every buffer), by their full names."""
        result = {}
        for name, value in self._registered().items():
            local = _local(value).detach()
            result[name] = local.cpu() if cast_to_cpu else local
        return result

    def load(self, values: dict[str, Any], partial: bool, strict: bool) -> None:
        """Load a full state dict (every rank keeps its shards of it) or this rank's partial
        one, saved by :meth:`local_state_dict` with the same degrees."""
        mine = self._registered()
        missing = sorted(set(mine) - set(values))
        unexpected = sorted(set(values) - set(mine))
        if strict and (missing or unexpected):
            raise ModelParallelError(
                f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
        with torch.no_grad():
            for name, tensor in mine.items():
                if name in values:
                    local, value = _local(tensor), values[name]
                    if not partial:
                        value = shard_of_whole(f"load_state_dict: {name!r}", tensor, value)
                    local.copy_(_same_shape(name, local, value))

    @staticmethod
    def as_shard(param: DTensor, name: str, value: torch.Tensor, partial: bool) -> DTensor:
        """An optimizer state tensor for sharded ``param``: ``value`` is this rank's shard
        (``partial``) or the whole tensor, of which this rank keeps its shard."""
        if isinstance(value, DTensor):
            return value.to(param.dtype) if value.is_floating_point() else value
        value = value.to(param.device, param.dtype if value.is_floating_point() else value.dtype)
        if partial:
            local = _same_shape(name, param.to_local(), value)
        else:
            local = shard_of_whole(f"optimizer load_state_dict: state of {name!r}", param, value)
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )

    @staticmethod
    def saved(value: Any, full: bool) -> Any:
        """A state value as saved: a sharded tensor's shard, or (``full``, a collective: every
        rank calls it in the same order) the whole tensor; on the CPU."""
        if not isinstance(value, torch.Tensor):
            return value
        if isinstance(value, DTensor):
            value = value.full_tensor() if full else value.to_local()
        return value.detach().cpu()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its shard if sharded."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_of_whole(what: str, tensor: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole``, the full value of ``tensor`` (itself when not sharded),
    cut as FSDP2 cut it: for a DTensor, along its mesh's dimensions from the last (a tp
    dimension) to the first, each ``torch.chunk``'s piece of this rank's coordinate (none for a
    rank beyond the pieces). By hand, as ``distribute_tensor`` refuses a tp shard that the
    shard group splits unevenly (FSDP2's ``_StridedShard``), which FSDP2 itself allows."""
    if whole.shape != tensor.shape:
        raise ModelParallelError(
            f"{what} has shape {tuple(whole.shape)} in the full state dict, the parameter "
            f"{tuple(tensor.shape)}"
        )
    if not isinstance(tensor, DTensor):
        return whole
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "every rank is on the mesh of its parameters"
    part = whole
    for dim in reversed(range(mesh.ndim)):
        cut = getattr(tensor.placements[dim], "dim", None)  # Shard's and _StridedShard's
        if cut is not None:
            pieces = torch.chunk(part, mesh.size(dim), dim=cut)
            index = coordinate[dim]
            part = pieces[index] if index < len(pieces) else part.narrow(cut, 0, 0)
    return part


def _same_shape(name: str, local: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if value.shape != local.shape:
        raise ModelParallelError(
            f"load_state_dict: {name!r} has shape {tuple(value.shape)} in the partial state "
            f"dict but this rank's shard has shape {tuple(local.shape)}: partial states load "
            "only with the sharded_data_parallel_degree they were saved with; save a full "
            "one (partial=False) to change it"
        )
    return value

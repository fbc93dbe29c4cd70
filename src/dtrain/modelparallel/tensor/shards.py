"""Parameters split over the tensor-parallel group: DTensors on the group's mesh.

A distributed module is built whole, as its plain equivalent, then its layers are split with
torch's parallel styles (``parallelize_module``), which cut every rank's shard from the weights
of the group's first rank (created without memory, it is made and split when the model is
wrapped: :func:`split_delayed`). What the rest of dtrain needs to know about such parameters lives
here: the whole value behind a shard (state dicts hold whole tensors, as SMP's ``state_dict``
does), the shard of a whole value (loading), and which parameters saw the group's combined batch
(:mod:`.batch`), whose gradients average differently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from dtrain.modelparallel import deferred, state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import hooks

PENDING = "_dtrain_pending_split"
"""The attribute holding the plan of a module created without memory, split once made."""

SCALED_BATCH = "_dtrain_scaled_batch"
"""The attribute marking a parameter of a distributed module (set on the parameter itself: a
set of tensors would compare them by value)."""

SCALED_NAMES = "_dtrain_scaled_batch_names"
"""The attribute of a module recording which of its own parameters carry :data:`SCALED_BATCH`
(name to mark): torch's conversions (``Module.to``, ``.cuda()``, ``.half()``) swap a DTensor
parameter with its converted copy, ``__dict__`` included, which drops the mark; the module
keeps it, and :func:`restore_marks` puts it back (``DistributedModel`` does when wrapping and
at every step)."""

SPLIT_BLOCK = "_dtrain_split_block"
"""The attribute marking a module whose layers ``parallelize`` split. Its forward computes on
their shards (and, for a distributed module, in the scaled-batch region), so a layer on another
partition would return there in the middle of the block's forward, which the pipeline's plan
order refuses: the block runs whole on one pipeline partition."""


def parallelize(
    module: nn.Module, plan: ParallelStyle | dict[str, ParallelStyle], what: str
) -> None:
    """Split ``module``'s layers by ``plan`` over the tp group (nothing at tp 1), and mark every
    parameter of ``module`` as one that sees the group's combined batch. A module created
    without memory (``smp.delay_param_initialization``) keeps the plan until
    :func:`split_delayed` makes it."""
    mesh = state.current(what).tensor_mesh
    if mesh is not None and any(deferred.is_deferred(p) for p in module.parameters()):
        setattr(module, PENDING, (plan, what))
    elif mesh is not None:
        before = {id(m): {*m._forward_pre_hooks, *m._forward_hooks} for m in module.modules()}
        parallelize_module(module, mesh, plan)
        for layer in module.modules():  # the styles' hooks convert where the layer computes
            added = {*layer._forward_pre_hooks, *layer._forward_hooks} - before[id(layer)]
            hooks.run_where_computed(layer, added)
    mark_block(module)


def mark_block(module: nn.Module) -> None:
    """Mark ``module`` a split block and every parameter of it one that sees the group's
    combined batch (a block whose layers are split one by one is marked as a whole here)."""
    setattr(module, SPLIT_BLOCK, True)
    mark_scaled_batch(module, True)  # marked again once split, when made


def mark_scaled_batch(module: nn.Module, scaled: bool) -> None:
    """Mark every parameter of ``module`` as one that sees the group's combined batch, or (not
    ``scaled``) its rank's own rows, on the parameter and in its module's record."""
    for sub in module.modules():
        names = sub.__dict__.setdefault(SCALED_NAMES, {})
        for name, param in sub.named_parameters(recurse=False):
            names[name] = scaled
            setattr(param, SCALED_BATCH, scaled)


def restore_marks(root: nn.Module) -> None:
    """Put the marks of :func:`mark_scaled_batch` back on the parameters of ``root`` from their
    modules' records (after a conversion swapped them away)."""
    for sub in root.modules():
        for name, scaled in getattr(sub, SCALED_NAMES, {}).items():
            param = sub._parameters.get(name)
            if param is not None:
                setattr(param, SCALED_BATCH, scaled)


def split_delayed(root: nn.Module, device: torch.device) -> None:
    """Make and split the distributed modules under ``root`` created without memory, one at a
    time: each is made whole with its eager values (:mod:`..deferred`) and split as an eager
    one is, so a rank holds at most one distributed module whole beside its shards. The rest
    of the model stays without memory until the first step. Called when the model is wrapped,
    before the script's optimizer takes its parameters."""
    for module in root.modules():
        pending = getattr(module, PENDING, None)
        if pending is None:
            continue
        delattr(module, PENDING)
        deferred.materialize([*module.parameters(), *module.buffers()], device)
        parallelize(module, *pending)


def split_blocks(root: nn.Module) -> set[str]:
    """Names of ``root``'s modules split by :func:`parallelize`: each stays on one pipeline
    partition (the automatic planner keeps them whole)."""
    return {name for name, module in root.named_modules() if getattr(module, SPLIT_BLOCK, False)}


def check_partition(root: nn.Module, owner: Callable[[str], int]) -> None:
    """Every split block of ``root`` and its submodules on one partition (``owner`` maps a
    module name to its partition); otherwise the first one cut, named with both partitions."""
    modules = dict(root.named_modules())
    for block in sorted(split_blocks(root)):
        for name, module in modules[block].named_modules(prefix=block):
            if owner(name) != owner(block):
                raise ModelParallelError(
                    f"smp.DistributedModel: module {block!r} "
                    f"({type(modules[block]).__name__}) is split over the tensor-parallel group "
                    f"and runs whole on one pipeline partition, but its submodule {name!r} "
                    f"({type(module).__name__}) is placed on partition {owner(name)} and it on "
                    f"{owner(block)}; allowed: the same partition"
                )


def is_scaled_batch(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter of a distributed module (SMP's "scaled batch"
    parameters): its gradient covers the batches of the whole tp group."""
    return getattr(tensor, SCALED_BATCH, False)


def is_distributed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is held as a DTensor (a shard, or a replica kept by the tp group)."""
    return isinstance(tensor, DTensor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of ``tensor`` (a collective over the tp group for a DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``, a plain tensor sharing its memory."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shared_input(tensor: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``tensor`` as the replicated DTensor input of column-split ``layer`` (``tensor`` itself
    when ``layer`` is not split). Layers given one such input (query, key, value) add their
    input gradients up locally, and its conversion all-reduces their sum once in backward;
    torch's ``ColwiseParallel``, given a plain tensor, converts it for each layer, which
    all-reduces each layer's input gradient. A weight that is a DTensor on another mesh (FSDP2's
    shard under sharded data parallelism, gathered only when its own unit runs) is not split
    over the tp group: ``tensor`` itself."""
    weight = layer.weight
    tensor_mesh = state.current("smp.nn attention").tensor_mesh
    if not isinstance(weight, DTensor) or weight.device_mesh is not tensor_mesh:
        return tensor
    return DTensor.from_local(tensor, weight.device_mesh, [Replicate()], run_check=False)


def shard_of(like: DTensor, value: torch.Tensor) -> DTensor:
    """``value``, a whole tensor every rank holds, laid out as ``like`` (cut locally)."""
    value = value.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def laid_out_as(param: torch.Tensor, value: torch.Tensor, whole_value: bool) -> torch.Tensor:
    """A saved tensor shaped like ``param`` (an optimizer state) laid out as ``param``: a whole
    value cut into this rank's shard, or this rank's saved part wrapped as one."""
    if not isinstance(param, DTensor):
        return value
    if whole_value:
        return shard_of(param, value)
    value = value.to(device=param.device)
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)


def load_into(tensor: torch.Tensor, value: torch.Tensor, whole_value: bool) -> None:
    """Copy ``value`` into ``tensor``: a whole value, or (``whole_value`` false) this rank's
    part of it, as ``local_state_dict`` saved it."""
    if not isinstance(tensor, DTensor):
        tensor.copy_(value)
    elif whole_value:
        tensor.copy_(shard_of(tensor, value))
    else:
        tensor.to_local().copy_(value)


def tp_batches(st: state.MPState) -> int:
    """How many batches a scaled-batch parameter's gradient sums on one rank: the tp group's
    (its ranks' batches, combined), or one with ``prescaled_batch`` (the group shares one). Its
    average divides by this beside the rdp degree; a plain parameter's is a mean."""
    return 1 if st.config["prescaled_batch"] else st.tp_size


def gradient_groups(
    params: list[torch.Tensor], st: state.MPState
) -> list[tuple[dist.ProcessGroup, int | None, list[torch.Tensor]]]:
    """How the gradients of ``params`` average: ``(group, divisor, local gradients)``, a
    ``None`` divisor meaning the group's mean.

    A plain parameter saw its rank's batch: the mean over the dp group. A scaled-batch one
    holds the sum over :func:`tp_batches` batches: summed over the rdp group and divided by the
    number of distinct batches (``dp_size``, ``rdp_size`` when prescaled)."""
    plain = [local(p.grad) for p in params if p.grad is not None and not is_scaled_batch(p)]
    scaled = [local(p.grad) for p in params if p.grad is not None and is_scaled_batch(p)]
    groups: list[tuple[dist.ProcessGroup, int | None, list[torch.Tensor]]] = []
    if plain:
        groups.append((st.dp_process_group, None, plain))
    if scaled:
        groups.append((st.rdp_process_group, st.rdp_size * tp_batches(st), scaled))
    return groups


def carry_earlier(grads: list[torch.Tensor], factor: int) -> None:
    """Ready the scaled-batch gradients of earlier steps (accumulating before one optimizer
    step, averaged by their own steps, so alike on every rank that averages them) for a step
    that averages them again with this step's: multiplied in place by ``factor``, the
    :func:`tp_batches` the average divides by, so that it leaves them as they were
    (``sum_rdp(t*e + n) / (rdp*t) = e + sum_rdp(n) / (rdp*t)``). No second buffer: a plain
    gradient's mean is linear (``mean(e + n) = e + mean(n)``) and so is a prescaled one's, so
    nothing else is touched. A step that fails leaves them multiplied beside its partial
    gradients: the script zeroes them."""
    if factor > 1 and grads:
        torch._foreach_mul_([local(g) for g in grads], factor)


def whole_state_dict_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """``state_dict()`` of a distributed module holds whole tensors, loadable into its plain
    equivalent (every rank of the tp group must call it)."""
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and isinstance(value, DTensor):
            state_dict[key] = value.full_tensor()


def shard_load_hook(
    module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any
) -> None:
    """``load_state_dict`` of whole tensors (a plain module's) into a distributed module."""
    assert isinstance(state_dict, dict)
    tensors = [*module.named_parameters(prefix[:-1]), *module.named_buffers(prefix[:-1])]
    for key, tensor in tensors:
        value = state_dict.get(key)
        plain = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
        if isinstance(tensor, DTensor) and plain and value.shape == tensor.shape:
            state_dict[key] = shard_of(tensor, value)

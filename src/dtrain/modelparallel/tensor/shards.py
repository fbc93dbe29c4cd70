"""Parameters split over the tensor-parallel group: DTensors on the group's mesh.

A distributed module is built whole, as its plain equivalent, then its layers are split with
torch's parallel styles (``parallelize_module``), which cut every rank's shard from the weights
of the group's first rank (created without memory, it is made and split when the model is
wrapped: :func:`split_delayed`). Which blocks were split (each stays on one pipeline partition)
and a distributed module's own state dicts (whole tensors, as SMP's ``state_dict`` holds) live
here; the whole value behind a shard and the shard of a whole value are :mod:`.dtensors`', and
which parameters saw the group's combined batch (:mod:`.batch`), whose gradients average
differently, :mod:`.averages`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from dtrain.modelparallel import deferred, state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import hooks
from dtrain.modelparallel.tensor.averages import mark_scaled_batch
from dtrain.modelparallel.tensor.dtensors import laid_out_as, whole

PENDING = "_dtrain_pending_split"
"""The attribute holding the plan of a module created without memory, split once made."""

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


def whole_state_dict_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """``state_dict()`` of a distributed module holds whole tensors, loadable into its plain
    equivalent (every rank of the tp group must call it)."""
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and isinstance(value, torch.Tensor):
            state_dict[key] = whole(value)


def shard_load_hook(
    module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any
) -> None:
    """``load_state_dict`` of whole tensors (a plain module's) into a distributed module."""
    assert isinstance(state_dict, dict)
    tensors = [  # every name of a tied parameter: a state dict holds each
        *module.named_parameters(prefix[:-1], remove_duplicate=False),
        *module.named_buffers(prefix[:-1], remove_duplicate=False),
    ]
    for key, tensor in tensors:
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        if isinstance(tensor, DTensor) and value.shape == tensor.shape:
            state_dict[key] = laid_out_as(f"load_state_dict: {key!r}", tensor, value, True)

"""The state dicts of the script's FSDP1 over SMP v2's layout (:mod:`dtrain.smpv2.fsdp`).

torch's FSDP1 states a model that holds tensor-parallel DTensors through its 2D extension, which
assumes a root mesh of two dimensions (FSDP's, then tp) and states each tensor as a DTensor of
the whole model over it. SMP's root mesh has three (replicate, hybrid_shard, tp), and SMP states
things otherwise:

* ``SHARDED_STATE_DICT``: SMP's scripts save one folder per tp rank (``tp{degree}-{rank}``),
  written by the first replica's shard group, as SMP's tensor-parallel layers hold their slices
  as plain tensors. :class:`LayoutExtensions` states each tensor as that rank's slice (a plain
  tensor whole) sharded over FSDP's own mesh, hybrid-sharded as FSDP holds it, so each folder
  is a whole checkpoint of its slice and loads at any hybrid shard degree (the same tensor
  parallel degree). torch's extension would state plain tensors sharded over the *replicas*
  (the root's first dimension), and each tp rank's slice as part of the whole tensor, which one
  tp rank's shard group cannot save alone (DCP refuses the plan);
* ``FULL_STATE_DICT`` gives the tensor-parallel parameters as DTensors, not the whole tensors a
  full checkpoint holds (SMP "translates the model back to the Hugging Face Transformers
  checkpoint format"): :func:`full_state_dict` gathers them, on every rank of their tp group
  (``rank0_only`` then keeps rank 0's only, as FSDP does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp._shard_utils import _create_chunk_dtensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel.fsdp import DTensorExtensions

from dtrain.smpv2.flat_params import flat_units


class LayoutExtensions(DTensorExtensions):
    """torch's 2D extension (flattening and restoring DTensors), stating each tensor as SMP does
    (see the module): this rank's slice, chunked over FSDP's mesh as torch chunks a tensor
    without tensor parallelism."""

    def chunk_dtensor(self, tensor: Tensor, rank: int, device_mesh: DeviceMesh) -> Tensor:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return _create_chunk_dtensor(local, rank, device_mesh)

    def all_gather_dtensor(self, tensor: DTensor, parent_mesh: DeviceMesh | None) -> Tensor:
        whole = [Replicate()] * tensor.device_mesh.ndim
        return tensor.redistribute(tensor.device_mesh, whole).to_local()


def place_on_layout(root: TorchFSDP) -> None:
    """Give every FSDP1 unit under ``root`` that states DTensors :class:`LayoutExtensions`
    (the unit's handle too, which flattens with it)."""
    for unit in TorchFSDP.fsdp_modules(root):
        extension = unit._fsdp_extension
        if isinstance(extension, DTensorExtensions) and not isinstance(extension, LayoutExtensions):
            unit._fsdp_extension = LayoutExtensions(extension.device_handle)
            if unit._handle is not None:
                unit._handle._fsdp_extension = unit._fsdp_extension


def holds_tensor_parallel(model: nn.Module) -> bool:
    """Whether an FSDP1 unit of ``model`` flattened tensor-parallel DTensors."""
    return any(
        extension is not None
        for unit in flat_units(model)
        for extension in unit.flat._param_extensions
    )


def full_state_dict(root: TorchFSDP, state_dict: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``state_dict()``, FSDP1's ``FULL_STATE_DICT`` of ``root``, with every DTensor gathered
    whole on every rank (a collective over each tp group, in the state dict's order, which every
    rank shares); with ``rank0_only`` the other ranks then drop what they gathered. On the CPU
    ``offload_to_cpu`` is left to FSDP off: the tensors are there already, and torch's FSDP1
    offloading CPU parameters crashes the process (a segmentation fault, torch 2.13)."""
    config = root._state_dict_config
    rank0_only = bool(getattr(config, "rank0_only", False))
    offload = bool(getattr(config, "offload_to_cpu", False))
    changes: dict[str, bool] = {}
    if root.compute_device is None or root.compute_device.type == "cpu":
        changes["offload_to_cpu"] = False
    tensor_parallel = holds_tensor_parallel(root)
    if tensor_parallel:
        changes["rank0_only"] = False
    with _configs_changed(root, changes):
        state = state_dict()
    if not tensor_parallel:
        return state
    for key, value in state.items():
        if isinstance(value, DTensor):
            whole = value.full_tensor()
            state[key] = whole.cpu() if offload else whole
    if rank0_only and root.rank != 0:
        return {k: v for k, v in state.items() if not isinstance(v, Tensor)}
    return state


@contextlib.contextmanager
def _configs_changed(root: TorchFSDP, changes: dict[str, bool]) -> Iterator[None]:
    """The state dict configs of ``root``'s units with ``changes`` meanwhile."""
    configs = {id(u._state_dict_config): u._state_dict_config for u in TorchFSDP.fsdp_modules(root)}
    saved = [
        (config, name, getattr(config, name)) for config in configs.values() for name in changes
    ]
    for config, name, _ in saved:
        setattr(config, name, changes[name])
    try:
        yield
    finally:
        for config, name, value in saved:
            setattr(config, name, value)

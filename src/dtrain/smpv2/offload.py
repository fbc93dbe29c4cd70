"""Activation offloading (``sm_activation_offloading``) over models ``tsm.transform`` split.

AWS's scripts offload with torch's ``offload_wrapper`` around the whole model. torch's wrapper
saves each tensor autograd keeps for backward into a new pinned host buffer (``torch.empty``,
then ``copy_``), which fails for a DTensor ("got mixed torch.Tensor and DTensor"): the weights of
a tensor-parallel model are DTensors here, and autograd keeps weights (SMP's Transformer Engine
layers hold plain tensors, so SMP's offloading never meets one). :class:`OffloadWrapper` offloads
a DTensor's local tensor as torch offloads any tensor, and rebuilds the DTensor around it, on the
same mesh and placements, when backward reads it; plain tensors go exactly as in torch's.

``offload_wrapper`` is served under torch's name once ``torch.sagemaker`` is imported
(:mod:`dtrain.compat.torch_offload`), as AWS's scripts import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    OffloadWrapper as TorchOffloadWrapper,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec


@dataclass(frozen=True)
class _OffloadedDTensor:
    """A DTensor's placement, and its local tensor as torch's offloading packed it."""

    spec: DTensorSpec
    local: Any


class save_on_host(saved_tensors_hooks):
    """torch's ``save_on_cpu(pin_memory=True)``, taking DTensors too."""

    def __init__(self) -> None:
        torch_hooks = save_on_cpu(pin_memory=True)

        def pack(tensor: Tensor) -> Any:
            if isinstance(tensor, DTensor):
                return _OffloadedDTensor(tensor._spec, torch_hooks.pack_hook(tensor._local_tensor))
            return torch_hooks.pack_hook(tensor)

        def unpack(packed: Any) -> Tensor:
            if isinstance(packed, _OffloadedDTensor):
                local = torch_hooks.unpack_hook(packed.local)
                return DTensor(local, packed.spec, requires_grad=False)
            return torch_hooks.unpack_hook(packed)

        super().__init__(pack, unpack)


class OffloadWrapper(TorchOffloadWrapper):
    """torch's ``OffloadWrapper`` (scripts and torch's ``isinstance`` checks see one), offloading
    with :class:`save_on_host`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with save_on_host():
            return self._checkpoint_wrapped_module(*args, **kwargs)


def offload_wrapper(module: nn.Module) -> nn.Module:
    """torch's ``offload_wrapper``: ``module``'s saved activations offloaded to host memory,
    DTensors included."""
    return OffloadWrapper(module)

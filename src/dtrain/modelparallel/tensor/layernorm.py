"""``smp.nn.FusedLayerNorm``: apex's fused layer norm as SMP re-exports it; and SMP's
``DistributedLayerNorm``."""

from __future__ import annotations

import torch
from torch import nn

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError

WHAT = "smp.nn.DistributedLayerNorm"


class FusedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` under apex's name and arguments (``normalized_shape, eps,
    elementwise_affine``): torch's kernel is already fused on GPUs, and on the CPU there is
    nothing to fuse."""


class DistributedLayerNorm(nn.LayerNorm):
    """SMP's ``DistributedLayerNorm(normalized_shape, eps)``: a layer norm over features split
    over the tp group (each rank's slice, the statistics summed over the group), which SMP's
    ``optimize: memory`` layouts use inside its distributed modules. dtrain lays them out as
    ``speed`` only, where a rank holds whole features: at tp 1 it is ``nn.LayerNorm``; at
    tp > 1 it fails, naming it, rather than normalize a slice as if it were whole."""

    def __init__(self, normalized_shape: int | list[int] | torch.Size, eps: float = 1e-5) -> None:
        degree = state.current(WHAT).tp_size
        if degree > 1:
            raise ModelParallelError(
                f"{WHAT}: features split over tensor_parallel_degree={degree} (SMP's "
                "optimize='memory' layouts) are not supported by dtrain; allowed: "
                "tensor_parallel_degree=1, or smp.nn.FusedLayerNorm for whole features"
            )
        super().__init__(normalized_shape, eps)

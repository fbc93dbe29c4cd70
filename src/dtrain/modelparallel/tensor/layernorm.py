"""``smp.nn.FusedLayerNorm``: apex's fused layer norm as SMP re-exports it."""

from __future__ import annotations

from torch import nn


class FusedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` under apex's name and arguments (``normalized_shape, eps,
    elementwise_affine``): torch's kernel is already fused on GPUs, and on the CPU there is
    nothing to fuse."""

"""SMP's helpers that AWS's scripts import from ``smdistributed.modelparallel.torch.utils``."""

from __future__ import annotations

import torch

from dtrain.modelparallel import state
from dtrain.modelparallel.tensor import dtensors


def get_distribution_axis(tensor: torch.Tensor) -> int | None:
    """The dimension along which tensor parallelism splits ``tensor`` (a parameter or buffer)
    over the tp group, or None when it does not (SMP's meaning: AWS's fp16 packages cut saved
    masters along it). A shard of sharded data parallelism alone is not split by tensor
    parallelism: None."""
    mesh = state.current("smp utils.get_distribution_axis").tensor_mesh
    if mesh is None or not dtensors.is_distributed(tensor):
        return None
    tp_name = (mesh.mesh_dim_names or ("",))[0]
    names = tensor.device_mesh.mesh_dim_names or ()
    if tp_name not in names:
        return None
    placement = tensor.placements[names.index(tp_name)]
    return getattr(placement, "dim", None)


def rmsg(msg: str) -> str:
    """``msg`` prefixed with this process's rank, as SMP's log lines are."""
    return f"[{state.rank()}] {msg}"

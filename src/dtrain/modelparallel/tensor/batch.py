"""SMP's scaled batch: inside a distributed module the tensor-parallel group works on the batches
of all its ranks at once.

Without ``prescaled_batch`` every rank of a tp group brings its own batch (data sharded by
``dp_rank``). The outermost distributed module a forward enters gathers its inputs over the
group along the batch dimension, every rank computes its shard of the layers on the combined
batch, and the outputs are cut back to each rank's own rows. With ``prescaled_batch`` the
group's ranks bring the same batch (data sharded by ``rdp_rank``) and nothing is gathered.

Both crossings are DTensor redistributions (``Shard(0)`` to ``Replicate()`` and back), so
autograd gives their backward: the gather's gradient is the rank's rows of the replicated
gradient, the scatter's an all-gather of every rank's output gradient. A parameter inside
therefore accumulates the gradient of the whole group's batch (:mod:`.shards` averages it
accordingly). Activations in the region are the same on every rank of the group, so dropout
must draw the same masks there: the outermost module runs under one seed, drawn by the group's
first rank from its own generator (so activation checkpointing, which restores the generator
for the recomputation, draws the same seed again).

With pipelines the region may call a module another partition owns: the request carries the
region's mark (:mod:`..pipeline.modes`), and there the module takes its inputs as the combined
batch they are and gives its outputs back whole; it draws its own group seed (that partition's
tp group runs the same requests in the same order).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtrain.modelparallel import state
from dtrain.modelparallel.pipeline import modes

T = TypeVar("T", torch.Tensor, None)

_inside = threading.local()


class ScaledBatch:
    """How the outermost distributed module of a forward crosses into the group's batch; every
    method is the identity when nothing is gathered (nested modules, tp 1, prescaled)."""

    def __init__(self, mesh: DeviceMesh | None) -> None:
        self.mesh = mesh

    def gather(self, local: T) -> T:
        """This rank's batch → the tp group's batches, concatenated in tp-rank order."""
        if self.mesh is None or local is None:
            return local
        shard = DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)
        return shard.redistribute(self.mesh, [Replicate()]).to_local()

    def scatter(self, combined: T) -> T:
        """The group's combined batch → this rank's rows of it."""
        if self.mesh is None or combined is None:
            return combined
        whole = DTensor.from_local(combined, self.mesh, [Replicate()], run_check=False)
        return whole.redistribute(self.mesh, [Shard(0)]).to_local()


@contextmanager
def scaled_batch(what: str) -> Iterator[ScaledBatch]:
    """The region of a distributed module's forward; ``what`` names it in errors."""
    st = state.current(what)
    outermost = not getattr(_inside, "depth", 0)
    if not outermost or st.tp_size == 1:
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            yield ScaledBatch(None)
        finally:
            _inside.depth -= 1
        return
    gathered = st.config["prescaled_batch"] or modes.in_tensor_region()
    devices = [st.device] if st.device.type == "cuda" else []
    _inside.depth = 1
    try:
        with torch.random.fork_rng(devices=devices), modes.tensor_region():
            torch.manual_seed(_group_seed(st))
            yield ScaledBatch(None if gathered else st.tensor_mesh)
    finally:
        _inside.depth = 0


def _group_seed(st: state.MPState) -> int:
    """A seed from the generator of the tp group's first rank, on every rank of the group."""
    seed = torch.randint(2**62, (1,), dtype=torch.int64)
    dist.broadcast(seed, src=st.tp_group[0], group=st.object_groups["tp"])
    return int(seed.item())

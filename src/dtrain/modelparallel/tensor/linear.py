"""``smp.nn.DistributedLinear``: a linear layer split by its input features (row-parallel)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel

from dtrain.modelparallel import state
from dtrain.modelparallel.tensor import shards
from dtrain.modelparallel.tensor.batch import check_batches
from dtrain.modelparallel.tensor.module import seeded, split, whole_state_dicts

WHAT = "smp.nn.DistributedLinear"


class DistributedLinear(nn.Linear):
    """``nn.Linear(in_features, out_features, bias)`` whose weight each rank of the tp group
    holds a slice of input features of. Each rank brings its own batch and gets its own rows
    back: the group's batches are exchanged so each rank multiplies the whole group's rows by
    its slice, and the partial products are summed and cut back into the ranks' rows in one
    reduce-scatter (torch's ``RowwiseParallel`` with ``Shard(0)`` on both sides; with
    ``prescaled_batch`` the group shares one batch and the sum is an all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        split(WHAT, "in_features", in_features)
        with seeded(WHAT):
            super().__init__(in_features, out_features, bias)
        whole_state_dicts(self)
        batch = Replicate() if state.current(WHAT).config["prescaled_batch"] else Shard(0)
        shards.parallelize(self, RowwiseParallel(input_layouts=batch, output_layouts=batch), WHAT)
        check_batches(self)

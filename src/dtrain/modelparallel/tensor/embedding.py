"""``smp.nn.DistributedEmbedding``: an embedding table split by its embedding dimension."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from dtrain.modelparallel import state
from dtrain.modelparallel.tensor import shards
from dtrain.modelparallel.tensor.batch import check_batches
from dtrain.modelparallel.tensor.module import (
    refuse_unsupported,
    seeded,
    split,
    whole_state_dicts,
)

WHAT = "smp.nn.DistributedEmbedding"


class DistributedEmbedding(nn.Embedding):
    """``nn.Embedding`` whose table each rank of the tp group holds a slice of columns of (as
    SMP splits it). Each rank brings its own batch of indices and gets its own rows of full
    embeddings: the indices are gathered over the group, each rank looks up its columns for
    all of them, and an exchange gives each rank its rows (torch's ``ColwiseParallel`` with
    ``Shard(0)`` on both sides). The table starts normal with ``initializer_range`` (or as
    ``_weight``). ``max_norm`` (which renormalises rows in place, a norm over every shard)
    and ``sparse`` gradients are not implemented, nor SMP's internal ``_skip_*`` switches, nor
    its ``vocab_parallel`` split (by rows)."""

    IMPLEMENTED_ONLY: ClassVar[Mapping[str, Any]] = {
        "max_norm": None,
        "sparse": False,
        "_skip_allgather": False,
        "_skip_scatter_and_merge": False,
        "vocab_parallel": False,
    }
    """Arguments implemented only at these (SMP's default) values: others fail, and a plain
    ``nn.Embedding`` with them is kept as it is when the model is wrapped (:mod:`.swap`)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        initializer_range: float = 0.02,
        _skip_allgather: bool = False,
        _skip_scatter_and_merge: bool = False,
        vocab_parallel: bool = False,
    ) -> None:
        given = {
            "max_norm": max_norm,
            "sparse": sparse,
            "_skip_allgather": _skip_allgather,
            "_skip_scatter_and_merge": _skip_scatter_and_merge,
            "vocab_parallel": vocab_parallel,
        }
        refuse_unsupported(WHAT, given, self.IMPLEMENTED_ONLY)
        split(WHAT, "embedding_dim", embedding_dim)
        with seeded(WHAT):
            super().__init__(
                num_embeddings,
                embedding_dim,
                padding_idx,
                norm_type=norm_type,
                scale_grad_by_freq=scale_grad_by_freq,
                _weight=_weight,
            )
            if _weight is None:
                with torch.no_grad():
                    nn.init.normal_(self.weight, std=initializer_range)
                    if self.padding_idx is not None:
                        self.weight[self.padding_idx].zero_()
        whole_state_dicts(self)
        batch = Replicate() if state.current(WHAT).config["prescaled_batch"] else Shard(0)
        shards.parallelize(self, ColwiseParallel(input_layouts=batch, output_layouts=batch), WHAT)
        check_batches(self)

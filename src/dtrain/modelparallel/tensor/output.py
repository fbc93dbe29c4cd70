"""``smp.nn.DistributedTransformerOutputLayer``: a transformer's feed-forward block, its inner
dimension split over the tp group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dtrain.modelparallel.tensor import shards
from dtrain.modelparallel.tensor.batch import scaled_batch
from dtrain.modelparallel.tensor.module import (
    UNSUPPORTED_EXTRAS,
    DistributedModule,
    check_speed_layout,
    init_linear,
    refuse_unsupported,
    seeded,
    split,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # dtrain's, for HF GPT-2
}


class DistributedTransformerOutputLayer(DistributedModule):
    """SMP's feed-forward block: ``dense1`` split by its outputs (torch's ``ColwiseParallel``),
    the activation (``gelu`` or ``relu``), ``dense2`` split by its inputs
    (``RowwiseParallel``: one all-reduce), dropout, the residual and a layer norm before
    and/or after. ``forward(hidden_states)`` → the block's output, same shape."""

    def __init__(
        self,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        refuse_unsupported(self.what, options, UNSUPPORTED_EXTRAS)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"{self.what}: activation={activation!r}; allowed: {', '.join(ACTIVATIONS)}"
            )
        check_speed_layout(self.what)
        split(self.what, "intermediate_size", intermediate_size)
        self.activation = activation
        with seeded(self.what):
            self.dense1 = nn.Linear(hidden_size, intermediate_size)
            self.dense2 = nn.Linear(intermediate_size, hidden_size)
            for layer in (self.dense1, self.dense2):
                init_linear(layer, use_normal_initialization, initializer_range)
        self.pre_layernorm = nn.LayerNorm(hidden_size, layernorm_epsilon) if pre_layernorm else None
        self.layernorm = nn.LayerNorm(hidden_size, layernorm_epsilon) if post_layernorm else None
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.residual = True
        """False in a parallel layer, which adds the residual once to both blocks' sum (and
        then applies this block's norm after, if any)."""
        plan = {"dense1": ColwiseParallel(), "dense2": RowwiseParallel()}
        shards.parallelize(self, plan, self.what)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with scaled_batch(self.what, hidden_states) as batch:
            return batch.scatter(self.feed_forward(batch.gather(hidden_states)))

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block on the tp group's combined batch (every rank its share of ``dense1``)."""
        inputs = hidden
        if self.pre_layernorm is not None:
            hidden = self.pre_layernorm(hidden)
        inner = ACTIVATIONS[self.activation](self.dense1(hidden))
        out = self.dropout(self.dense2(inner))
        if not self.residual:
            return out
        out = out + inputs
        return out if self.layernorm is None else self.layernorm(out)

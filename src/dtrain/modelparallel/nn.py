"""``smp.nn``: SMP's tensor-parallel modules (``smdistributed.modelparallel.torch.nn``).

Each takes SMP's constructor arguments and forward inputs and splits its layers over the
tensor-parallel group (``tensor_parallel_degree``) as DTensors; at degree 1 it is a plain module.
"""

from dtrain.modelparallel.tensor import huggingface
from dtrain.modelparallel.tensor.attention import DistributedAttentionLayer
from dtrain.modelparallel.tensor.embedding import DistributedEmbedding
from dtrain.modelparallel.tensor.flash import FlashAttentionLayer
from dtrain.modelparallel.tensor.layernorm import DistributedLayerNorm, FusedLayerNorm
from dtrain.modelparallel.tensor.linear import DistributedLinear
from dtrain.modelparallel.tensor.output import DistributedTransformerOutputLayer
from dtrain.modelparallel.tensor.transformer import (
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
)

__all__ = [
    "DistributedAttentionLayer",
    "DistributedEmbedding",
    "DistributedLayerNorm",
    "DistributedLinear",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer",
    "FlashAttentionLayer",
    "FusedLayerNorm",
    "huggingface",
]

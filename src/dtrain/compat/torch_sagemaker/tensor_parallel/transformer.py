"""``torch.sagemaker.tensor_parallel.transformer``: the transformer layer of transformed models
(AWS's scripts wrap it in FSDP units and activation checkpointing). SMP's Transformer Engine
layer is not built here: AWS's scripts take it only on torch below 2.2."""

from dtrain.smpv2.layer import TransformerLayer
from dtrain.smpv2.unavailable import Unavailable

TETransformerLayer = Unavailable("torch.sagemaker.tensor_parallel.transformer.TETransformerLayer")

__all__ = ["TETransformerLayer", "TransformerLayer"]

"""``torch.sagemaker.tensor_parallel.transformer``: the transformer layer of transformed models
(AWS's scripts wrap it in FSDP units and activation checkpointing)."""

from dtrain.smpv2.unavailable import Unavailable

_HERE = "torch.sagemaker.tensor_parallel.transformer"
TransformerLayer = Unavailable(f"{_HERE}.TransformerLayer")
TETransformerLayer = Unavailable(f"{_HERE}.TETransformerLayer")

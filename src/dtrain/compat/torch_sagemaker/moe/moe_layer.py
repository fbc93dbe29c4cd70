"""``torch.sagemaker.moe.moe_layer``."""

from dtrain.smpv2.unavailable import Unavailable

MoELayer = Unavailable("torch.sagemaker.moe.moe_layer.MoELayer")

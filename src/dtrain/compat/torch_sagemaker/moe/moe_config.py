"""``torch.sagemaker.moe.moe_config``."""

from dtrain.smpv2.unavailable import Unavailable

MoEConfig = Unavailable("torch.sagemaker.moe.moe_config.MoEConfig")

"""``torch.sagemaker.delayed_param``: creating a model's parameters once FSDP has sharded it."""

from dtrain.smpv2.unavailable import Unavailable

DelayedParamIniter = Unavailable("torch.sagemaker.delayed_param.DelayedParamIniter")

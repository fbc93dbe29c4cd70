"""``torch.sagemaker.delayed_param``: creating a model's parameters once FSDP has sharded it."""

from dtrain.smpv2.delayed_param import DelayedParamIniter

__all__ = ["DelayedParamIniter"]

"""``torch.sagemaker.distributed.checkpoint.state_dict_loader``."""

from dtrain.smpv2.unavailable import Unavailable

load = Unavailable("torch.sagemaker.distributed.checkpoint.state_dict_loader.load")

"""``torch.sagemaker.distributed.checkpoint.async_utils``."""

from dtrain.smpv2.unavailable import Unavailable

AsyncCallsQueue = Unavailable("torch.sagemaker.distributed.checkpoint.async_utils.AsyncCallsQueue")

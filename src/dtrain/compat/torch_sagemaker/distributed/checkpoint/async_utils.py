"""``torch.sagemaker.distributed.checkpoint.async_utils``:
see :mod:`dtrain.smpv2.checkpoint.async_calls`."""

from dtrain.smpv2.checkpoint.async_calls import AsyncCallsQueue

__all__ = ["AsyncCallsQueue"]

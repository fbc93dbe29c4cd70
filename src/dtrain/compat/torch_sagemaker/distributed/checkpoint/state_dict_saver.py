"""``torch.sagemaker.distributed.checkpoint.state_dict_saver``."""

from dtrain.smpv2.unavailable import Unavailable

_HERE = "torch.sagemaker.distributed.checkpoint.state_dict_saver"
save = Unavailable(f"{_HERE}.save")
async_save = Unavailable(f"{_HERE}.async_save")
maybe_finalize_async_calls = Unavailable(f"{_HERE}.maybe_finalize_async_calls")
PyTorchDistSaveShardedStrategy = Unavailable(f"{_HERE}.PyTorchDistSaveShardedStrategy")

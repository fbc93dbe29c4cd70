"""``torch.sagemaker.distributed.checkpoint.state_dict_saver``:
see :mod:`dtrain.smpv2.checkpoint.saving`.

``PyTorchDistSaveShardedStrategy`` (Megatron's save strategy, which AWS's scripts import but do
not use) is not built: it fails naming itself when used."""

from dtrain.smpv2.checkpoint.saving import async_save, maybe_finalize_async_calls, save
from dtrain.smpv2.unavailable import Unavailable

PyTorchDistSaveShardedStrategy = Unavailable(
    "torch.sagemaker.distributed.checkpoint.state_dict_saver.PyTorchDistSaveShardedStrategy"
)

__all__ = ["PyTorchDistSaveShardedStrategy", "async_save", "maybe_finalize_async_calls", "save"]

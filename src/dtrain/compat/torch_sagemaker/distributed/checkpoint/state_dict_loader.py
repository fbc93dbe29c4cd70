"""``torch.sagemaker.distributed.checkpoint.state_dict_loader``:
see :mod:`dtrain.smpv2.checkpoint.loading`."""

from dtrain.smpv2.checkpoint.loading import load

__all__ = ["load"]

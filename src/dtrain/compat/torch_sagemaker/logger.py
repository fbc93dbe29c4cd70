"""``torch.sagemaker.logger``: see :mod:`dtrain.smpv2.logger`."""

from dtrain.smpv2.logger import get_logger

__all__ = ["get_logger"]

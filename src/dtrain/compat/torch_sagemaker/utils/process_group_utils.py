"""``torch.sagemaker.utils.process_group_utils``: see :mod:`dtrain.smpv2.utils`."""

from dtrain.smpv2.utils import get_global_ranks

__all__ = ["get_global_ranks"]

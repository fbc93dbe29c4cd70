"""``torch.sagemaker.checkpoint.utils``: keeping the newest checkpoint folders
(:mod:`dtrain.smpv2.checkpoint.subdirs`)."""

from dtrain.smpv2.checkpoint.subdirs import SORT_BY_LAST_INT, limit_num_subdirs

__all__ = ["SORT_BY_LAST_INT", "limit_num_subdirs"]

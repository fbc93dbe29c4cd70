"""``torch.sagemaker.checkpoint.utils``: keeping the newest checkpoint folders."""

from dtrain.smpv2.unavailable import Unavailable

_HERE = "torch.sagemaker.checkpoint.utils"
SORT_BY_LAST_INT = Unavailable(f"{_HERE}.SORT_BY_LAST_INT")
limit_num_subdirs = Unavailable(f"{_HERE}.limit_num_subdirs")

"""``smdistributed.modelparallel.torch.utils``: the helpers AWS's scripts import (see
``dtrain.modelparallel.api.smp_utils``)."""

from dtrain.modelparallel.api.smp_utils import get_distribution_axis, rmsg

__all__ = ["get_distribution_axis", "rmsg"]

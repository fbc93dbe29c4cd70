"""``smdistributed.modelparallel.torch.nn``: see ``dtrain.modelparallel.nn``."""

from dtrain.modelparallel import nn
from dtrain.modelparallel.nn import *  # noqa: F403  (the module is the API)

__all__ = nn.__all__

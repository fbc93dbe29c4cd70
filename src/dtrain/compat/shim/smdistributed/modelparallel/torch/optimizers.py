"""``smdistributed.modelparallel.torch.optimizers``: see ``dtrain.modelparallel.optimizers``."""

from dtrain.modelparallel.optimizers import FusedLAMB

__all__ = ["FusedLAMB"]

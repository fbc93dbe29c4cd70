"""``smdistributed.dataparallel.torch.parallel``: see ``dtrain.dataparallel``."""

from dtrain.dataparallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]

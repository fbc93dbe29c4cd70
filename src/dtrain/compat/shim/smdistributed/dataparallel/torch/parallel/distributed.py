"""``from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel``."""

from dtrain.dataparallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]

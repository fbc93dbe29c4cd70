"""SMDDP v1 API (``import smdistributed.dataparallel.torch.distributed as dist``), from dtrain."""

from dtrain import dataparallel
from dtrain.dataparallel import *  # noqa: F403  (the module is the API)

__all__ = dataparallel.__all__

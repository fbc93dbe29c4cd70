"""SMDDP v1 API (``import smdistributed.dataparallel.torch.distributed as dist``), from dtrain."""

from dtrain.dataparallel import (
    ReduceOp,
    all_gather,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_available,
    is_initialized,
)

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "is_available",
    "is_initialized",
]

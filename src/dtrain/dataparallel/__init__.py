"""Data parallelism with SMDDP's API (``smdistributed.dataparallel.torch``) on torch.distributed.

``init_process_group`` joins the job from the launcher's environment; ``DistributedDataParallel``
averages gradients with balanced buckets, overlapped with backward, hierarchically across hosts;
``ShardedSampler`` and ``shard_files`` split the data; ``register_smddp_backend`` makes
``torch.distributed.init_process_group(backend="smddp")`` work for scripts written for SMDDP v1.4+.
"""

from dtrain.dataparallel.backend import register_smddp_backend
from dtrain.dataparallel.collectives import (
    ReduceOp,
    all_gather,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    group,
)
from dtrain.dataparallel.ddp import DistributedDataParallel
from dtrain.dataparallel.process_group import (
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_available,
    is_initialized,
)
from dtrain.dataparallel.sampler import ShardedSampler, shard_files

__all__ = [
    "DistributedDataParallel",
    "ReduceOp",
    "ShardedSampler",
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
    "register_smddp_backend",
    "shard_files",
]

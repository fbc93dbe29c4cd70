"""Which ranks a distributed checkpoint is saved or loaded over, and which of them coordinates.

SMP v2 scripts pass ``process_group`` (FSDP's shard group, or a replication group) and
``coordinator_rank`` as a *global* rank, the group's lowest (``min(get_global_ranks(group))``);
torch's DCP takes the coordinator as a rank within the group. A coordinator outside the group
fails naming both.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.utils import _DistWrapper


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def coordinator_index(process_group: dist.ProcessGroup | None, coordinator_rank: int | None) -> int:
    """The group rank of the global rank ``coordinator_rank`` (None: the group's first rank)."""
    if coordinator_rank is None or not distributed():
        return 0
    group = _group(process_group)
    ranks = dist.get_process_group_ranks(group)
    if coordinator_rank not in ranks:
        raise ValueError(
            f"coordinator_rank {coordinator_rank} is not in the process group (global ranks "
            f"{ranks}): give one of them, as min(get_global_ranks(process_group))"
        )
    return dist.get_group_rank(group, coordinator_rank)


def wrapper(process_group: dist.ProcessGroup | None, coordinator_rank: int | None) -> _DistWrapper:
    """torch's exception-robust collectives over ``process_group`` (every rank sees any rank's
    failure), coordinated by ``coordinator_rank``; without a world, over this process alone."""
    index = coordinator_index(process_group, coordinator_rank)
    return _DistWrapper(process_group, distributed(), index)


def group_ranks(process_group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``process_group`` (the world's for None), [0] without a world."""
    if not distributed():
        return [0]
    return dist.get_process_group_ranks(_group(process_group))


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    group = process_group or dist.group.WORLD
    assert group is not None  # a world exists
    return group

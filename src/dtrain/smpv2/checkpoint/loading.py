"""``torch.sagemaker.distributed.checkpoint.state_dict_loader.load``: torch's DCP ``load``
(in place into ``state_dict``'s tensors, each rank reading what its own tensors hold, whatever
the layout the checkpoint was saved at) through a :class:`DistributedFileSystemReader` unless
the script gives a reader: nothing unpickled but what a checkpoint holds (:mod:`.unpickling`),
and every element a rank asks for must be there (:mod:`.storage`)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from dtrain.smpv2.checkpoint.coordination import coordinator_index, distributed
from dtrain.smpv2.checkpoint.storage import DistributedFileSystemReader


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int | None = None,
) -> None:
    """Load the checkpoint at ``checkpoint_id`` (a folder or an ``s3://`` prefix), or
    ``storage_reader``'s, into ``state_dict`` in place; every rank of ``process_group`` (the
    world by default) calls it. ``coordinator_rank`` (global) must be in the group; the group's
    first rank coordinates (which one does changes nothing that is read)."""
    coordinator_index(process_group, coordinator_rank)
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError(
                "load: give a checkpoint_id (a folder or s3:// prefix) or a storage_reader"
            )
        storage_reader, checkpoint_id = DistributedFileSystemReader(checkpoint_id), None
    dcp.load(
        state_dict,
        checkpoint_id=checkpoint_id,
        storage_reader=storage_reader,
        planner=planner,
        process_group=process_group,
        no_dist=not distributed(),
    )

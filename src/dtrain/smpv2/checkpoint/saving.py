"""``torch.sagemaker.distributed.checkpoint.state_dict_saver``: ``save``, ``async_save`` and
``maybe_finalize_async_calls``, DCP-style (``checkpoint_id`` or a ``storage_writer``, a
``planner``, a ``process_group`` and its ``coordinator_rank``).

``save`` returns once the checkpoint is written. ``async_save`` copies ``state_dict``'s tensors
to new CPU tensors (so training may change the originals at once), plans the save over the group
(a collective: every rank of ``process_group`` calls it), starts writing this rank's files in a
background thread and returns; the checkpoint exists once a later
``maybe_finalize_async_calls`` on every rank of the group has found all files written and
written the metadata. Until then a reader finds no checkpoint there (no ``.metadata``), never a
partial one.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter

from dtrain.smpv2.checkpoint.async_calls import AsyncCallsQueue
from dtrain.smpv2.checkpoint.coordination import group_ranks, wrapper
from dtrain.smpv2.checkpoint.pending import PendingSave
from dtrain.smpv2.checkpoint.storage import DistributedFileSystemWriter

_QUEUE = AsyncCallsQueue()
"""The queue of ``async_save`` calls that name none, which ``maybe_finalize_async_calls`` serves."""


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int | None = None,
) -> Metadata:
    """Save ``state_dict`` (every rank of ``process_group``, the world by default, calls it)
    to ``checkpoint_id`` (a folder or an ``s3://`` prefix) or through ``storage_writer``;
    ``coordinator_rank`` (global) writes the metadata. Returns the checkpoint's metadata."""
    pending = _planned(
        state_dict, checkpoint_id, storage_writer, planner, process_group, coordinator_rank
    )
    return pending.finish(pending.write)


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    coordinator_rank: int | None = None,
    queue: AsyncCallsQueue | None = None,
) -> int:
    """Start saving a copy of ``state_dict`` as :func:`save` would; it is written in the
    background and finished by ``maybe_finalize_async_calls`` of ``queue`` (or this module's,
    for the default queue). Returns the save's number in its queue."""
    staged = _copy_state_dict(state_dict, _create_cpu_state_dict(state_dict), type_check=False)
    pending = _planned(
        staged, checkpoint_id, storage_writer, planner, process_group, coordinator_rank
    )
    return (queue or _QUEUE).schedule(pending)


def maybe_finalize_async_calls(
    blocking: bool = False, process_group: dist.ProcessGroup | None = None
) -> list[int]:
    """Finish the saves of ``async_save`` calls given no queue that every rank has written
    (see :meth:`AsyncCallsQueue.maybe_finalize_async_calls`)."""
    return _QUEUE.maybe_finalize_async_calls(blocking, process_group)


def _planned(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str] | None,
    storage_writer: StorageWriter | None,
    planner: SavePlanner | None,
    process_group: dist.ProcessGroup | None,
    coordinator_rank: int | None,
) -> PendingSave:
    if storage_writer is None:
        if checkpoint_id is None:
            raise ValueError(
                "save: give a checkpoint_id (a folder or s3:// prefix) or a storage_writer"
            )
        storage_writer = DistributedFileSystemWriter(checkpoint_id)
    elif checkpoint_id is not None:
        storage_writer.reset(checkpoint_id)  # as torch's save: the writer, at checkpoint_id
    state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
    return PendingSave.planned(
        state,
        storage_writer,
        planner or DefaultSavePlanner(),
        wrapper(process_group, coordinator_rank),
        tuple(group_ranks(process_group)),
    )

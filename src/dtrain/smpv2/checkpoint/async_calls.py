"""``torch.sagemaker.distributed.checkpoint.async_utils.AsyncCallsQueue``: the saves a rank
has started with ``async_save`` and not yet finished.

Each save's files are written in the queue's writer thread (one save after another); the save
is finished (its metadata written, which makes it a checkpoint) by
:meth:`AsyncCallsQueue.maybe_finalize_async_calls`, which every rank of the save's group calls at
the same point of its program, as SMP's scripts do before the next save and after training. It
asks the group whether every rank's files are written, so all of them finish the save together,
or none does yet.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.checkpoint.storage import WriteResult

from dtrain.smpv2.checkpoint.coordination import group_ranks
from dtrain.smpv2.checkpoint.pending import PendingSave


@dataclass(frozen=True)
class _Call:
    index: int
    save: PendingSave
    written: Future[list[WriteResult]]


class AsyncCallsQueue:
    """The asynchronous saves of this rank, oldest first."""

    def __init__(self) -> None:
        self._calls: list[_Call] = []
        self._numbers = itertools.count()
        self._writer: ThreadPoolExecutor | None = None

    def schedule(self, save: PendingSave) -> int:
        """Start writing ``save``'s files in the background; its number in this queue."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="dtrain-checkpoint-writer")
        call = _Call(next(self._numbers), save, self._writer.submit(save.write))
        self._calls.append(call)
        return call.index

    def maybe_finalize_async_calls(
        self, blocking: bool = False, process_group: dist.ProcessGroup | None = None
    ) -> list[int]:
        """Finish the saves whose files every rank of their group has written (with
        ``blocking``, waiting for this rank's first); the numbers of those finished. A save
        that failed on any rank raises here, on every rank of its group.

        Every rank of each save's group calls it. ``process_group``, as SMP's scripts pass it,
        must be the group the saves were made over (the check runs over each save's own group).
        """
        finished: list[int] = []
        for call in list(self._calls):
            if process_group is not None and group_ranks(process_group) != list(call.save.ranks):
                raise ValueError(
                    f"maybe_finalize_async_calls: process_group has ranks "
                    f"{group_ranks(process_group)}, the save it would finish was made over "
                    f"{list(call.save.ranks)}: pass the group given to async_save"
                )
            if blocking:
                wait([call.written])
            done = call.save.collectives.all_gather_object(call.written.done())
            if all(done):
                self._calls.remove(call)
                call.save.finish(call.written.result)
                finished.append(call.index)
        return finished

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def close(self) -> None:
        """Finish every save (a collective, as :meth:`maybe_finalize_async_calls` with
        ``blocking``) and stop the writer thread."""
        self.maybe_finalize_async_calls(blocking=True)
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None

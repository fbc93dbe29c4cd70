"""Random generators forked for a block of one task: the block's own while its task holds the
compute token.

torch's default generators are the process's, shared by every thread. A block that forks them
(``torch.random.fork_rng``: save on entry, seed, restore on exit) assumes that nothing else draws
until it ends, which a pipeline's tasks break: a task gives the compute token back while it
waits for another rank inside the block (a tensor-parallel region whose layers run on the next
partition, ended on its second visit here), and the task that takes the token meanwhile draws,
perhaps forking in turn. Restores made last in, first out then cross: the other task draws from
the block's generator (and shifts the block's later draws), the block's exit puts back a state
that lacks those draws, and where the blocks end in the order they began, the last exit puts
back the first block's own state, which the process then draws from after the step (the same on
every rank of a tensor-parallel group, whose regions share their seeds).

:class:`ForkedGenerators` makes the fork its task's: while the task is away (it gave the token
up) the process's state is installed, and the block's is kept aside; when the task holds the
token again, the process's state, advanced by whatever the others drew, is kept aside in turn.
So the block draws exactly what it would draw alone, and the process's generator exactly what
it would without the block. The compute token switches the task's forks
(:attr:`.tasks.RunningTask.owned`) as it hands the token over.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from dtrain.modelparallel.modules.tasks import running_task


class ForkedGenerators:
    """The CPU generator and those of ``devices`` (CUDA), forked and seeded with ``seed``, as
    ``fork_rng(devices=devices)`` with the seed set inside, but switched in and out with the
    token by :meth:`leave` and :meth:`resume`.

    Only those generators are seeded: ``torch.manual_seed`` would seed every CUDA device too
    (queued until CUDA starts, if it has not), which the fork does not restore, so a rank's
    GPU would draw from the block's seed ever after, as every rank whose blocks share it."""

    def __init__(self, seed: int, devices: Sequence[torch.device] = ()) -> None:
        self.devices = tuple(devices)
        self._aside = self._states()
        """The process's states while the block's are installed; the block's while away."""
        self.away = False
        torch.default_generator.manual_seed(seed)
        for device in self.devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)

    def _states(self) -> list[torch.Tensor]:
        return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in self.devices)]

    def _swap(self) -> None:
        """Install the states kept aside, keeping aside the installed ones."""
        installed = self._states()
        torch.set_rng_state(self._aside[0])
        for device, saved in zip(self.devices, self._aside[1:], strict=True):
            torch.cuda.set_rng_state(saved, device)
        self._aside = installed

    def leave(self) -> None:
        """The task gives the token up: the process's states come back, the block's wait."""
        if not self.away:
            self._swap()
            self.away = True

    def resume(self) -> None:
        """The task holds the token again: the block's states come back."""
        if self.away:
            self._swap()
            self.away = False

    def close(self) -> None:
        """The block ends: the process's states come back (away, they are there already)."""
        self.leave()


@contextmanager
def forked(seed: int, devices: Sequence[torch.device] = ()) -> Iterator[ForkedGenerators]:
    """Fork the generators for the block, owned by the task the calling thread runs as (outside
    tasks nobody takes the token in between: a plain fork)."""
    generators = ForkedGenerators(seed, devices)
    task = running_task()
    owned = task.owned if task is not None else []
    owned.append(generators)
    try:
        yield generators
    finally:
        owned.remove(generators)
        generators.close()

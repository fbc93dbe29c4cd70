"""A step's work as tasks: which task the calling thread runs as, what a task holds only while
it computes, what a microbatch's task gave.

The pipeline runs the step body and served requests as tasks, one thread each, that take turns
on the rank's compute token (:mod:`..pipeline.compute_token`). Code that has no token at hand (a
tensor-parallel region forking the random generators, :mod:`.generators`) finds the task it runs
in here, and hands it what must follow the token (:class:`Owned`). Outside a pipeline no thread
runs as a task, and such state is plainly the process's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

MicrobatchResult = tuple[bool, Any]
"""``(True, value)`` for a microbatch that returned, ``(False, exception)`` for one that raised."""


class Owned(Protocol):
    """Process-wide state a task has set up (a forked random generator: see :mod:`.generators`)
    that is the task's only while it holds the token."""

    def leave(self) -> None:
        """The task gives the token up: put the state aside, put the process's back."""

    def resume(self) -> None:
        """The task holds the token again: put the state back."""


class RunningTask(Protocol):
    """What a task offers code running in it: the state it holds only with the token, innermost
    last."""

    owned: list[Owned]


_running = threading.local()
"""The task each thread runs as (:func:`running_as`): a thread runs one task at a time."""


def running_task() -> RunningTask | None:
    """The task the calling thread runs as, if any (never the pipeline's main task)."""
    return getattr(_running, "task", None)


@contextmanager
def running_as(task: RunningTask) -> Iterator[None]:
    """The calling thread runs as ``task`` in the block."""
    previous = running_task()
    _running.task = task
    try:
        yield
    finally:
        _running.task = previous

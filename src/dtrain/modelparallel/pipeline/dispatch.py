"""What a rank does with the messages it receives: decided on one thread, in arrival order.

Receiver threads (one per peer, :mod:`..transport.wire`) only decode messages and queue them here;
replies are the exception, they complete the future their requester waits on. A
:class:`Dispatcher` thread takes the queued streams in order and hands each to the runtime,
which decides what happens (a stream of requests becomes one task, a step's end goes to the
main thread). One thread for every decision needs no lock between them; the one rule with
state, which requests must wait for the end of a step (:class:`StepGate`), is plain data,
tested as tables without threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Stream = TypeVar("Stream")


@dataclass
class StepGate(Generic[Stream]):
    """Requests of the leader's step ``n + 1`` wait on this rank for the end of step ``n``.

    Messages from different peers are not ordered with each other: a request of the next step
    that another rank sent before this rank got the end of the current one must wait for that
    end, so that this rank first finishes its own work of the step (its optimizer step).
    """

    ended: int = 0
    """The last of the leader's steps whose end this rank has received."""
    early: list[tuple[int, Stream]] = field(default_factory=list)
    """Streams that came too early, with their step, in arrival order."""

    def admit(self, step: int, stream: Stream) -> bool:
        """Whether a stream of ``step`` may be served now; if not, it is kept for later."""
        if step > self.ended + 1:
            self.early.append((step, stream))
            return False
        return True

    def end(self, step: int) -> list[Stream]:
        """The leader ended ``step``: the kept streams now due, in arrival order."""
        self.ended = step
        due = [stream for kept, stream in self.early if kept <= step + 1]
        self.early = [(kept, stream) for kept, stream in self.early if kept > step + 1]
        return due


class Dispatcher(Generic[Stream]):
    """One thread that hands the queued streams to ``handle``, in the order they were queued.

    A failure inside ``handle`` goes to ``failed`` (the rank's pipeline is broken) and the
    thread goes on, so that later messages (a peer's failure, a stop) still arrive.
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[Stream], None],
        failed: Callable[[BaseException], None],
    ) -> None:
        self._queue: queue.SimpleQueue[tuple[Stream] | None] = queue.SimpleQueue()
        self._handle, self._failed = handle, failed
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, stream: Stream) -> None:
        """Queue a stream (a receiver thread): nothing else happens on the receiver."""
        self._queue.put((stream,))

    def close(self, timeout: float) -> None:
        """Handle what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._handle(item[0])
            except BaseException as exc:  # a bug must not silence the rank's messages
                self._failed(exc)
            item = None  # its tensors are not kept while waiting for the next stream

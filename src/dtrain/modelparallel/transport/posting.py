"""Streams handed to gloo in the order they were sent, each once its bytes are in host memory.

A stream with GPU tensors is complete only when its copies to pinned host memory have run on
the GPU. Waiting for them on the sending thread made the CPU wait for the GPU at every send (the
copies come after the compute queued before them), so the CPU could not queue the next work
while the GPU computed, and GPU time showed as the sender's. A stream whose copies are still
running is queued instead, with the event recorded after them, and a thread of the
transport's own waits for each event in turn and posts the stream; the sender goes on at once.

Order is kept across both kinds: a stream is posted on the sending thread only when nothing is
queued or being waited for before it, else it is queued behind the rest. Posts (the sealing, the
wait for the previous stream to the peer, the sends) happen under one lock, re-entrant so that a
post that fails the transport may send the failure on from inside it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class Completion(Protocol):
    """What a queued stream waits for (a ``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


class Poster(Generic[T]):
    """Posts items with ``post`` in submission order, each after its completion (if any)."""

    def __init__(
        self, post: Callable[[T], None], failed: Callable[[BaseException], None], name: str
    ) -> None:
        """``post`` hands an item to the network; ``failed`` gets what a post on the poster's
        thread raised (a post on the sending thread raises there)."""
        self._post = post
        self._failed = failed
        self._name = name
        self.lock = threading.RLock()
        """Held while an item is posted: what must not interleave with a post takes it."""
        self._changed = threading.Condition(self.lock)
        self._queue: deque[tuple[T, Completion | None]] = deque()
        self._waiting = False
        """The thread holds an item it has not posted yet."""
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, item: T, completion: Completion | None = None) -> None:
        """Post ``item`` after every item submitted before it, once ``completion`` has
        completed: at once on this thread if nothing is to wait for, else on the poster's."""
        with self.lock:
            if completion is None and not self._queue and not self._waiting:
                self._post(item)
                return
            self._queue.append((item, completion))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if not self._queue:
                    return
                item, completion = self._queue.popleft()
                self._waiting = True
            try:
                if completion is not None:
                    completion.synchronize()  # without the lock: senders queue meanwhile
                with self.lock:
                    self._post(item)
            except BaseException as exc:
                self._failed(exc)
            finally:
                del item
                with self.lock:
                    self._waiting = False
                    self._changed.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until every item submitted so far is posted; False if some were not in time."""
        with self.lock:
            return self._changed.wait_for(lambda: not self._queue and not self._waiting, timeout)

    def close(self) -> None:
        """The thread ends once the queue is empty (call after :meth:`drain`)."""
        with self.lock:
            self._closed = True
            self._changed.notify_all()

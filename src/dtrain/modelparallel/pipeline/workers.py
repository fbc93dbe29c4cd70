"""Threads for pipeline tasks, kept and reused.

A task may block for long (waiting for the compute token or a remote reply), so tasks cannot
share a fixed number of threads: the pool grows to the number of tasks alive at once and keeps
its threads for the next ones. Reuse matters: a new thread starts with an empty allocator cache,
so every tensor it makes faults its pages in again (measured: a transformer layer's forward and
backward took 2.7× the wall time in fresh threads, most of it in the kernel).

Every thread runs its autograd calls itself: on CUDA, autograd would otherwise run every
backward on one device thread shared by all threads, and a task's backward that waits for
another rank (a remote call's gradients) would hold up every other task's backward behind it.
On CUDA each thread also starts on the rank's device, so ``.cuda()`` in module code lands there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


class WorkerPool:
    """Runs callables on daemon threads, reusing idle ones (a stuck thread never blocks exit)."""

    def __init__(self, name: str, device: torch.device | None = None) -> None:
        self._name = name
        self._device = device
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._count = 0

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self._count += 1
                number = self._count
        if inbox is not None:
            inbox.put(work)
            return
        inbox = queue.SimpleQueue()
        inbox.put(work)
        threading.Thread(
            target=self._loop, args=(inbox,), name=f"{self._name}-{number}", daemon=True
        ).start()

    def _loop(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        torch.autograd.set_multithreading_enabled(False)  # thread-local: this thread's backwards
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            work = inbox.get()
            try:
                work()
            finally:
                # An idle thread must not keep its last task alive: a served forward's
                # partial holds the received inputs and the call's outputs, with them its
                # autograd graph (what a split backward left of it), until the thread's next
                # task; with a pool of threads that is any number of steps later.
                del work
                with self._lock:
                    self._idle.append(inbox)

    @property
    def size(self) -> int:
        """Threads started so far."""
        return self._count

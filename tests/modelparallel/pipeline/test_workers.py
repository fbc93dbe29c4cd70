"""The runtime's task threads."""

from __future__ import annotations

import threading

import torch

from dtrain.modelparallel.pipeline.workers import WorkerPool


def test_pool_threads_run_their_own_backwards() -> None:
    """On CUDA autograd would run every thread's backward on one shared device thread, where a
    backward waiting for another rank holds up all the others: each task thread runs its own."""
    seen: list[bool] = []
    done = threading.Event()

    def task() -> None:
        seen.append(torch._C._is_multithreading_enabled())
        done.set()

    WorkerPool("test").submit(task)
    assert done.wait(10)
    assert seen == [False]
    assert torch._C._is_multithreading_enabled(), "the caller's thread is left alone"

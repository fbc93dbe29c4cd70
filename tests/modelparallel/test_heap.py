"""glibc's heap returns a rank's freed large blocks, or keeps them for any of its threads, and
MKL frees its threads' buffers (:mod:`dtrain.modelparallel.heap`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from dtrain.modelparallel import heap
from dtrain.modelparallel.state import keeps_freed_blocks

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")

FREE_AND_MEASURE = """
import sys, torch
from dtrain.modelparallel import heap
if sys.argv[1] == "fixed":
    assert heap.prepare(keep_freed_blocks=False) == [heap.THRESHOLD_ENV]
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
block = torch.ones(16 << 18); del block  # 16 MiB: freeing it raises glibc's default threshold
before = resident_mib()
block = torch.ones(8 << 18); del block   # 8 MiB
print(resident_mib() - before)
"""

FREE_ON_ONE_THREAD_REUSE_ON_ANOTHER = """
import resource, sys, threading, torch
from dtrain.modelparallel import heap
print(",".join(heap.prepare(keep_freed_blocks=sys.argv[1] == "kept")))
freed, over = threading.Event(), threading.Event()
def first():  # a microbatch's activations, freed; the thread waits in the pool
    blocks = [torch.ones(1 << 18) for _ in range(32)]  # 32 x 1 MiB
    del blocks
    freed.set()
    over.wait()
def second():  # the next microbatch's, on another pooled thread: its pages faulted in
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    blocks = [torch.ones(1 << 18) for _ in range(32)]
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
pooled = threading.Thread(target=first)
pooled.start()
freed.wait()
thread = threading.Thread(target=second)
thread.start()
thread.join()
over.set()
pooled.join()
"""


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """``script``'s lines of output, run in a fresh process: glibc's settings are the
    process's, and their environment variables are read as it starts."""
    command = [sys.executable, "-c", script, *args]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.update(env or {})
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=environment)
    return done.stdout.splitlines()


@glibc
def test_a_freed_large_block_goes_back_to_the_system() -> None:
    """With glibc's rising threshold the freed 8 MiB stay resident; fixed, they go back."""
    assert int(_run(FREE_AND_MEASURE, "default")[0]) >= 7
    assert int(_run(FREE_AND_MEASURE, "fixed")[0]) <= 1


@glibc
def test_blocks_one_thread_frees_serve_another_threads_requests() -> None:
    """Kept for reuse, 32 MiB freed on one thread serve another's next 32 MiB without faulting
    their pages in again (one arena for both); returned, or kept in an arena per thread (the
    job's own MALLOC_ARENA_MAX, left to glibc), the second thread faults in every page anew."""
    made, fresh = _run(FREE_ON_ONE_THREAD_REUSE_ON_ANOTHER, "returned")
    assert made == heap.THRESHOLD_ENV
    made, kept = _run(FREE_ON_ONE_THREAD_REUSE_ON_ANOTHER, "kept")
    assert made.split(",") == [heap.ARENA_ENV, heap.THRESHOLD_ENV, heap.TRIM_ENV]
    own_arenas = {heap.ARENA_ENV: "8"}
    made, apart = _run(FREE_ON_ONE_THREAD_REUSE_ON_ANOTHER, "kept", env=own_arenas)
    assert made.split(",") == [heap.THRESHOLD_ENV, heap.TRIM_ENV]
    assert int(fresh) >= 2048, "32 MiB, in pages of 4 KiB (or a few at a fault)"
    assert int(kept) < int(fresh) / 10
    assert int(apart) > int(fresh) / 2


def test_the_jobs_own_settings_are_left_to_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(heap.THRESHOLD_ENV, "65536")
    monkeypatch.setenv(heap.ARENA_ENV, "4")
    monkeypatch.setenv(heap.TRIM_ENV, "131072")
    assert heap.prepare(keep_freed_blocks=True) == []
    assert heap.prepare(keep_freed_blocks=False) == []


@pytest.mark.parametrize(
    ("pipeline", "optimize", "kept"),
    [(2, "speed", True), (2, "memory", False), (1, "speed", False), (1, "memory", False)],
)
def test_only_pipelines_planned_for_speed_keep_freed_blocks(
    pipeline: int, optimize: str, kept: bool
) -> None:
    """Planned for memory, or sharded data parallelism (which gathers and frees parameters at
    every use), large blocks go back to the system."""
    assert keeps_freed_blocks({"pipeline_parallel_degree": pipeline, "optimize": optimize}) is kept


@pytest.mark.skipif(heap.blas_buffer_bytes() is None, reason="torch without MKL")
def test_blas_buffers_of_idle_threads_are_released() -> None:
    """Threads that multiplied and wait (as a rank's pooled threads between steps) keep MKL's
    buffers until they are released, from another thread."""
    heap.release_blas_buffers()
    computed, stop = threading.Barrier(4), threading.Event()

    def idle_after_a_product() -> None:
        torch.randn(64, 256) @ torch.randn(256, 512)
        computed.wait(10)
        stop.wait(10)

    threads = [threading.Thread(target=idle_after_a_product) for _ in range(3)]
    for thread in threads:
        thread.start()
    computed.wait(10)
    try:
        assert heap.blas_buffer_bytes(), "each thread keeps its buffers"
        heap.release_blas_buffers()
        assert heap.blas_buffer_bytes() == 0
    finally:
        stop.set()
        for thread in threads:
            thread.join()

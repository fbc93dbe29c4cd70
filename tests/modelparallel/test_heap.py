"""glibc's heap returns a rank's freed large blocks and MKL its threads' buffers
(:mod:`dtrain.modelparallel.heap`)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from dtrain.modelparallel import heap

FREE_AND_MEASURE = """
import sys, torch
from dtrain.modelparallel import heap
if sys.argv[1] == "fixed":
    assert heap.keep_large_blocks_returnable()
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
block = torch.ones(16 << 18); del block  # 16 MiB: freeing it raises glibc's default threshold
before = resident_mib()
block = torch.ones(8 << 18); del block   # 8 MiB
print(resident_mib() - before)
"""


def _kept_mib(mode: str) -> int:
    command = [sys.executable, "-c", FREE_AND_MEASURE, mode]
    return int(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_freed_large_block_goes_back_to_the_system() -> None:
    """With glibc's rising threshold the freed 8 MiB stay resident; fixed, they go back."""
    assert _kept_mib("default") >= 7
    assert _kept_mib("fixed") <= 1


def test_the_jobs_own_setting_is_left_to_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(heap.ENV, "65536")
    assert not heap.keep_large_blocks_returnable()


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

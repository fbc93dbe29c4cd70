"""glibc's heap and MKL's buffers, kept from hoarding the memory a rank frees.

glibc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap``, returned to
the system when freed; smaller ones come from heaps ("arenas", one per thread that allocates,
up to eight per core) that keep what is freed for later requests. The threshold starts at
128 KiB and, by default, rises to the size of every such block freed, up to 32 MiB: after a
rank frees its first activations, blocks of that size come from the arenas. The pipeline
computes on several threads, each with its arena, so what one thread frees is not what another
asks for, and a rank's resident memory grows far beyond what it holds: on the 218M-parameter
benchmark LM with 4 partitions, the last rank peaked at 2.3 GiB with the rising threshold and
1.6-1.7 GiB with a fixed 1 MiB one (``benchmarks/large_models.py``).

So :func:`keep_large_blocks_returnable` fixes the threshold at :data:`MMAP_THRESHOLD`, which
also stops it rising, unless the job set glibc's ``MALLOC_MMAP_THRESHOLD_`` itself (then
glibc already applies the job's value). Elsewhere than glibc it does nothing.

MKL, torch's CPU BLAS on x86, keeps its own: each thread that multiplies matrices gets packing
buffers from MKL's allocator (about 10 MiB for the benchmark LM's 8192-wide head), kept in that
thread's pool for its next product. One process multiplies on one thread; a pipeline rank on
each of its pooled threads, so it kept a set for every thread that ever computed, through the
optimizer step and between steps (on the benchmark's pp=4 last rank 47 MiB in 15 buffers after
its first step). :func:`release_blas_buffers` frees every thread's unused ones; the pipeline
calls it once a rank's step is over (:meth:`~.pipeline.runtime.PipelineRuntime.run_step`), and
the next step makes them again (each thread's first product pays for its pages, once a step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from pathlib import Path

import torch

M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the threshold (``malloc.h``)."""

MMAP_THRESHOLD = 1 << 20
"""Blocks of 1 MiB and more are mapped on their own and returned when freed: tensors that size
are the ones whose reuse across threads fails, and smaller ones are cheaper to keep."""

ENV = "MALLOC_MMAP_THRESHOLD_"


def keep_large_blocks_returnable() -> bool:
    """Fix glibc's mmap threshold for this process; whether it was set here."""
    if ENV in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """torch's library with MKL's allocator in it (linked in, its service names exported), or
    None where torch has no MKL (another BLAS, another platform)."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        library = ctypes.CDLL(str(path))  # already loaded by torch: the same handle
        library.mkl_serv_free_buffers.argtypes = []
        library.mkl_serv_mem_stat.argtypes = [ctypes.POINTER(ctypes.c_int)]
        library.mkl_serv_mem_stat.restype = ctypes.c_int64
    except (OSError, AttributeError):
        return None
    return library


def release_blas_buffers() -> None:
    """Free the buffers MKL keeps for every thread and none is using (none without MKL).

    MKL's ``mkl_free_buffers``, under the service name torch's library exports. Only unused
    buffers go, so a thread computing meanwhile keeps its own (tried: 20 s of frees beside three
    threads multiplying, every product exact). The per-thread ``mkl_thread_free_buffers``, run
    on each thread, would leave one of each thread's two buffers.
    """
    library = _mkl()
    if library is not None:
        library.mkl_serv_free_buffers()


def blas_buffer_bytes() -> int | None:
    """Bytes MKL's allocator holds for all threads of the process; None without MKL."""
    library = _mkl()
    if library is None:
        return None
    count = ctypes.c_int(0)
    return int(library.mkl_serv_mem_stat(ctypes.byref(count)))

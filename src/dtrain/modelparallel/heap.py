"""glibc's heap and MKL's buffers, set for how a rank computes and what its job optimizes.

glibc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap``, returned to
the system when freed; smaller ones come from heaps ("arenas", one per thread that allocates,
up to eight per core) that keep what is freed for later requests. The threshold starts at
128 KiB and, by default, rises to the size of every such block freed, up to 32 MiB: after a
rank frees its first activations, blocks of that size come from the arenas. The pipeline
computes on several threads, each with its arena, so what one thread frees is not what another
asks for, and a rank's resident memory grows far beyond what it holds: on the 218M-parameter
benchmark LM with 4 partitions, the last rank peaked at 2.3 GiB with the rising threshold and
1.6-1.7 GiB with a fixed 1 MiB one (``benchmarks/large_models.py``).

Returning every large block costs time, though: each one mapped again faults in its pages, one
fault per 4 KiB, every microbatch (the benchmark pipeline's 4-block LM of width 256: 40 blocks
of 1 MiB a step on each rank, 15-24 thousand faults against torch's 1F1B's 0-3 thousand, its
step 6-10% slower). So :func:`prepare` chooses by what the job optimizes:

* a pipeline planned for speed (``optimize: "speed"``, SMP's default) has every thread allocate
  from one arena (:data:`M_ARENA_MAX` 1), so that a block one thread frees serves the next
  request of any thread, and the threshold fixed at glibc's own ceiling for its rising one
  (:data:`KEPT_BLOCKS_THRESHOLD`), so that blocks come from that arena as in one torch process
  (the benchmark LM's faults and CPU time per step are then those of torch's 1F1B).
  Freed blocks stay in the arena for the next microbatch and step: the 218M LM's pp=4 ranks
  peaked 14% higher than with returned blocks.
* otherwise (planned for memory, or no pipeline: sharded data parallelism gathers and frees
  parameters at every use) the threshold is fixed at :data:`RETURNED_BLOCKS_THRESHOLD`, which
  also stops it rising, and each thread keeps its arena.

A setting the job made itself (glibc's ``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``) is left to glibc. The arena limit holds for threads that first
allocate after it (threads that allocated before keep their arenas, and new ones are spread
over those), which is why ``smp.init`` sets it before it joins the world. Elsewhere than glibc
nothing is done.

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
from collections.abc import Callable
from pathlib import Path

import torch

M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the threshold (``malloc.h``)."""

M_ARENA_MAX = -8
"""``mallopt``'s parameter number for the most arenas (``malloc.h``)."""

M_TRIM_THRESHOLD = -1
"""``mallopt``'s parameter number for the free memory at the heap's top kept from the system."""

RETURNED_BLOCKS_THRESHOLD = 1 << 20
"""Blocks of 1 MiB and more are mapped on their own and returned when freed: tensors that size
are the ones whose reuse across threads fails, and smaller ones are cheaper to keep."""

KEPT_BLOCKS_THRESHOLD = 32 << 20
"""glibc's ceiling for its rising threshold (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit), fixed
from the start: only blocks larger than any a default heap keeps are mapped on their own."""

KEPT_BLOCKS_TRIM = 2 * KEPT_BLOCKS_THRESHOLD
"""The free top of the heap kept with it: what glibc's rising threshold sets beside it (a fixed
threshold leaves 128 KiB, so the blocks a microbatch freed, once merged into the top, went back
to the system and were faulted in again by the next)."""

THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
ARENA_ENV = "MALLOC_ARENA_MAX"
TRIM_ENV = "MALLOC_TRIM_THRESHOLD_"


def prepare(keep_freed_blocks: bool) -> list[str]:
    """Set glibc's heap for this process (see the module's docstring): with
    ``keep_freed_blocks``, one arena for every thread and large blocks kept for reuse; without,
    large blocks returned when freed. The environment variables of the settings made here (a
    job's own is left to glibc)."""
    mallopt = _mallopt()
    if mallopt is None:
        return []
    if keep_freed_blocks:
        settings = [
            (ARENA_ENV, M_ARENA_MAX, 1),
            (THRESHOLD_ENV, M_MMAP_THRESHOLD, KEPT_BLOCKS_THRESHOLD),
            (TRIM_ENV, M_TRIM_THRESHOLD, KEPT_BLOCKS_TRIM),
        ]
    else:
        settings = [(THRESHOLD_ENV, M_MMAP_THRESHOLD, RETURNED_BLOCKS_THRESHOLD)]
    return [
        env
        for env, parameter, value in settings
        if env not in os.environ and mallopt(parameter, value)
    ]


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


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

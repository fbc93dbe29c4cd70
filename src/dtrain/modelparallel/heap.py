"""glibc's heap, kept from hoarding the memory a rank frees.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

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

"""How the benchmarks measure a process's memory: its resident set (RSS) now, its peak
(Linux's high-water mark, which can be reset), and what it holds by owner.

Large tensors are allocated with ``mmap`` and returned on ``free``, so resident memory follows
them; the peak counts everything the process held, torch itself included, which is why the
benchmarks compare it with one process's, measured alike.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
from typing import Any

import torch

from dtrain.modelparallel import heap

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_mib() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / 2**20


def reset_peak() -> None:
    """Start the peak resident set size again from the current one."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def peak_mib() -> float:
    """The peak resident set size since the process started or :func:`reset_peak`."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def lifetime_peak_mib() -> float:
    """The peak resident set size since the process started (``ru_maxrss``, which
    :func:`reset_peak` does not reset)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks"),
            *("uordblks", "fordblks", "keepcost"),
        )
    ]


def held(state: list[torch.Tensor]) -> dict[str, float]:
    """What this process holds now, in MiB, by owner: resident memory, the tensors ``state``
    (a model's parameters, gradients, optimizer state), the other CPU tensors Python reaches,
    MKL's buffers, and glibc's heap in use and free."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state}
    others = {}
    for found in gc.get_objects():
        if issubclass(type(found), torch.Tensor) and found.device.type == "cpu":
            storage = found.untyped_storage()
            if storage.data_ptr() not in storages:
                others[storage.data_ptr()] = storage.nbytes()
    figures = {
        "resident": resident_mib() * 2**20,
        "state": sum(storages.values()),
        "other_tensors": sum(others.values()),
        "mkl_buffers": heap.blas_buffer_bytes() or 0,
        "heap_in_use": info.uordblks,
        "heap_free": info.fordblks,
    }
    return {name: value / 2**20 for name, value in figures.items()}


def held_text(figures: dict[str, float]) -> str:
    """What :func:`held` measured, as a table's text."""
    return ", ".join(f"{name} {value:.1f}" for name, value in figures.items())


def layout_lines(layouts: dict[str, Any], width: int) -> list[str]:
    """A memory table's lines, one per layout (its largest peak over one process's, and each
    rank's peak), then what each rank held after its last step where that was measured."""
    lines = []
    for label, row in layouts.items():
        peaks = " ".join(f"{p:6.0f}" for p in row["peak_rss_mib"])
        ratio = row["largest_over_single"]
        lines.append(f"  {label:{width}} largest/one process {ratio:.3f}  [{peaks}]")
        for rank, figures in enumerate(row["held_after_mib"]):
            if figures:
                lines.append(f"    rank {rank} after its last step, MiB: {held_text(figures)}")
    return lines

"""Helpers AWS's scripts import from ``torch.sagemaker.utils``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from dtrain.smpv2.logger import get_logger


@contextmanager
def timeit(enabled: bool, name: str, rank: int = 0) -> Iterator[None]:
    """Log how long the block took (``"Model creation took 1.23 s"``), from rank 0 only, so a
    job's log has one line per block however many ranks time it."""
    start = time.perf_counter()
    yield
    if enabled and rank == 0:
        get_logger().info("%s took %.3f s", name, time.perf_counter() - start)


def get_global_ranks(process_group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``process_group``'s members (the world's for ``None``), in group
    rank order."""
    return dist.get_process_group_ranks(process_group or dist.group.WORLD)

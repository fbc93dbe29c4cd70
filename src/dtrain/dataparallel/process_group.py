"""Joining the job's process group from the launcher's environment, and asking where we are in it.

The launcher (``dtrain.launch``, torchrun, or mpirun for the ``smdistributed`` strategy) sets
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``;
under mpirun only ``OMPI_COMM_WORLD_*`` may be present, so those are the fallback.
Hosts are groups of ``LOCAL_WORLD_SIZE`` consecutive ranks, as the launcher fills them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from dtrain.dataparallel.backend import SMDDP, register_smddp_backend


def is_available() -> bool:
    """True when torch.distributed is built in and this process was launched as part of a job."""
    return dist.is_available() and (dist.is_initialized() or _env_int("RANK") is not None)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """Join the job: env:// rendezvous (torch's default), NCCL when CUDA is available, else gloo.

    If a default group already exists (the script or a framework made one) it is used as is, so
    calling this twice, or after ``torch.distributed.init_process_group``, is harmless.
    ``backend="smddp"`` registers dtrain's ``smddp`` backend first. Other keyword arguments
    (``timeout``, ``init_method``, ...) go to ``torch.distributed.init_process_group``.
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == SMDDP:
        register_smddp_backend()
    if _env_int("RANK") is None and "init_method" not in kwargs and "store" not in kwargs:
        # mpirun sets only OMPI_COMM_WORLD_*; env:// still finds MASTER_ADDR/PORT
        rank, world = _env_int("OMPI_COMM_WORLD_RANK"), _env_int("OMPI_COMM_WORLD_SIZE")
        if rank is not None and world is not None:
            kwargs.setdefault("rank", rank)
            kwargs.setdefault("world_size", world)
    dist.init_process_group(backend=backend, **kwargs)


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def get_local_size() -> int:
    """Processes on this host: ``LOCAL_WORLD_SIZE``, else MPI's local size, else the whole world."""
    world = dist.get_world_size()
    size = _env_int("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE") or world
    if world % size:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={size} does not divide the world size {world}: every host must "
            "run the same number of processes"
        )
    return size


def get_local_rank() -> int:
    """This process's index on its host: ``LOCAL_RANK``, else MPI's local rank, else derived."""
    local = _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
    return local if local is not None else dist.get_rank() % get_local_size()


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None

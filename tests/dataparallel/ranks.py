"""Run a list of scenarios in a fresh world of processes and collect their results.

Each pool is one world: processes start once (forked from the tests' fork server), run
every scenario of the pool in order on the same process group, save what they return, and exit.
Hosts are simulated by ``LOCAL_WORLD_SIZE``, as the launcher sets it. The world is gloo, or NCCL
with a GPU per rank.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtrain.jobkey import KEY_ENV
from tests.forkserver import Inheritance, rank_context

Scenario = Callable[[int, int], dict[str, Any]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_pool(
    scenarios: list[Scenario],
    world: int,
    local_size: int,
    out: Path,
    timeout: float = 150,
    backend: str = "gloo",
    environment: Mapping[str, str] | None = None,
) -> list[dict[str, dict[str, Any]]]:
    """Per rank: scenario name -> what the scenario returned on that rank (tensors on the CPU).

    ``backend="nccl"`` puts rank r on GPU r; ``environment`` is added to every rank's."""
    env = {
        **(environment or {}),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_size),
        KEY_ENV: os.urandom(32).hex(),
    }
    rank_context()  # the server its ranks fork from
    context = mp.start_processes(
        _worker,
        args=(Inheritance(), env, scenarios, str(out), backend),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"ranks did not finish within {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(10)
    return [torch.load(out / f"rank{rank}.pt", map_location="cpu") for rank in range(world)]


def _worker(
    rank: int,
    inherited: Inheritance,
    env: dict[str, str],
    scenarios: list[Scenario],
    out: str,
    backend: str,
) -> None:
    inherited.take()
    os.environ.pop("DTRAIN_HIERARCHICAL_ALLREDUCE", None)
    local_size = int(env["LOCAL_WORLD_SIZE"])
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank % local_size))
    torch.set_num_threads(1)
    from dtrain.dataparallel import init_process_group

    if backend == "nccl":
        torch.cuda.set_device(rank)
    init_process_group(backend, timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    results = {scenario.__name__: scenario(rank, world) for scenario in scenarios}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()

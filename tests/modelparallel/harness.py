"""Run a function on N spawned ranks with the environment ``dtrain run`` gives them.

``run_ranks(world_size, fn, *args)`` starts one process per rank (forked from the tests' fork
server, :mod:`tests.forkserver`; one torch thread each), sets
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``,
the ``OMPI_COMM_WORLD_*`` twins and a job key (``DTRAIN_JOB_KEY``), calls ``fn(*args)`` and
returns each rank's result in rank order. ``fn`` creates the process group itself (usually
through ``smp.init()``); whatever the model-parallel runtime or torch.distributed still holds is
torn down after it returns. A rank that raises fails the call with that rank's traceback; ranks
that are still running at the deadline are killed.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dtrain.jobkey import KEY_ENV
from tests.forkserver import Inheritance, rank_context

GRACE = 5.0
"""Seconds the other ranks get to finish once one rank failed."""


class RankFailed(AssertionError):
    """One or more ranks raised, died or hung; the message holds what each reported."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def first_visible_gpu() -> str:
    """A ``CUDA_VISIBLE_DEVICES`` that shows only the first GPU this process may use: ranks
    spawned with it share one GPU however many the machine has."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[0] if visible else "0"


def launcher_env(rank: int, world_size: int, local_size: int, port: int) -> dict[str, str]:
    """The rendezvous variables ``dtrain run`` sets for ``rank``."""
    local = rank % local_size
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(local_size),
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(world_size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
    }


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    local_size: int | None = None,
) -> list[Any]:
    """``fn(*args)`` on every rank of a fresh world; each rank's return value, in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function); ``env`` is added to every
    rank's environment; ``local_size`` ranks per simulated host (default: all on one host).
    Once a rank fails, the others get ``GRACE`` seconds to finish before they are killed.
    """
    local_size = local_size or world_size
    port = free_port()
    context = rank_context()
    inherited = Inheritance()
    environment = {KEY_ENV: os.urandom(32).hex(), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="dtrain-ranks-") as scratch:
        out = Path(scratch)
        processes = [
            context.Process(
                target=_worker,
                args=(
                    rank,
                    world_size,
                    local_size,
                    port,
                    inherited,
                    environment,
                    fn,
                    args,
                    scratch,
                ),
                name=f"rank{rank}",
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
                if any(out.glob("*.failed")) or any(p.exitcode for p in processes):
                    deadline = min(deadline, time.monotonic() + GRACE)
                time.sleep(0.05)
        finally:
            hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join(10)
        return _collect(out, [p.exitcode for p in processes], hung, timeout)


def _collect(out: Path, exitcodes: list[int | None], hung: list[int], timeout: float) -> list[Any]:
    """Results in rank order, their tensors on the CPU (a GPU rank's are compared with
    references there); raises listing the failures, the earliest (likely the cause) first."""
    results: list[Any] = []
    problems: list[tuple[float, str]] = []
    for rank, exitcode in enumerate(exitcodes):
        file = out / f"rank{rank}.pt"
        if not file.exists():
            why = "killed: still running" if rank in hung else f"exited with code {exitcode}"
            problems.append((math.inf, f"rank {rank}: {why}, no result (timeout {timeout:g} s)"))
            results.append(None)
            continue
        ok, value = torch.load(file, weights_only=False, map_location="cpu")
        if not ok:
            problems.append((file.stat().st_mtime, f"rank {rank} raised:\n{value}"))
        results.append(value)
    if problems:
        raise RankFailed("\n".join(text for _, text in sorted(problems, key=lambda p: p[0])))
    return results


def _worker(
    rank: int,
    world_size: int,
    local_size: int,
    port: int,
    inherited: Inheritance,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: str,
) -> None:
    inherited.take()
    os.environ.update(launcher_env(rank, world_size, local_size, port))
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        outcome: tuple[bool, Any] = (True, fn(*args))
    except BaseException:
        outcome = (False, traceback.format_exc())
    try:
        _teardown()
    except Exception:
        if outcome[0]:
            outcome = (False, traceback.format_exc())
    partial = Path(out) / f".rank{rank}.pt"
    torch.save(outcome, partial)
    partial.rename(Path(out) / f"rank{rank}.pt")
    if not outcome[0]:
        (Path(out) / f"rank{rank}.failed").touch()


def _teardown() -> None:
    import torch.distributed as dist

    from dtrain.modelparallel import state

    state.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def single_process(config: Mapping[str, Any] | None = None) -> Iterator[None]:
    """``smp.init(config)`` in this process as a world of one; shut down afterwards.

    The launcher's variables are hidden meanwhile, so the world is always this process alone.
    """
    from dtrain.modelparallel import state

    names = ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
    names += ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        state.init(config)
        yield
    finally:
        state.shutdown()
        os.environ.update(saved)


def train_steps(
    model: Any,
    optimizer: Any,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[float]:
    """Train a ``smp.DistributedModel`` one step per ``(x, y)`` batch; the step losses."""
    import dtrain.modelparallel as smp

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        losses.append(float(train_step(model, x, y).reduce_mean()))
        optimizer.step()
    return losses


def sum_step() -> Callable[..., Any]:
    """An ``smp.step`` that backpropagates the sum of the model's output on ``x`` and returns it."""
    import dtrain.modelparallel as smp

    @smp.step
    def train(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        model.backward(loss)
        return loss

    return train

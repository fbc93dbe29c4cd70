"""A fork of the process's random generators belongs to the task that made it, switched in and
out with the compute token: two tasks' forks interleaved on one rank (a tensor-parallel region
that waits for another partition, and another microbatch's region meanwhile), in the orders a
plan runs them, each draw exactly what it would draw alone, and the process's generator what it
would draw without them. Without processes or threads: one thread hands the token between two
tasks as their threads would."""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch

from dtrain.modelparallel.modules.generators import ForkedGenerators, forked
from dtrain.modelparallel.pipeline.compute_token import ComputeToken, Task
from dtrain.modelparallel.scheduling.ordering import FreeOrdering
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.tensor import module

ORDERS = {
    # F0, F1, 2:F0, 2:F1: A's region (an LM head's) ends on its second visit, after B's began.
    "crossed": "o A+ A >B o B+ B >A A A- o >B B B- o",
    # B's region begins and ends while A waits; A's ends after it.
    "nested": "o A+ A >B o B+ B B- o >A A A- o",
    # A's region ends while it is away (its step failed): the process's state stays installed.
    "ended away": "o A+ A >B o A- B+ B B- o",
}
"""What the token's holder does, in order: ``o`` draws outside any region; ``X+`` draws a seed
outside (as a region does) and forks with it; ``X`` draws inside its region; ``X-`` ends the
region; ``>X`` hands the token to ``X``."""


def _draw(generator: torch.Generator | None = None) -> list[float]:
    return torch.rand(3, generator=generator).tolist()


def _seed(generator: torch.Generator | None = None) -> int:
    return int(torch.randint(2**62, (1,), generator=generator).item())


def _replay(order: str) -> tuple[dict[str, list[list[float]]], torch.Tensor]:
    """The draws each region and the process make as if alone, and the process's last state."""
    process = torch.Generator().manual_seed(11)
    regions: dict[str, torch.Generator] = {}
    draws: dict[str, list[list[float]]] = {"o": [], "A": [], "B": []}
    for step in order.split():
        if step == "o":
            draws["o"].append(_draw(process))
        elif step.endswith("+"):
            regions[step[0]] = torch.Generator().manual_seed(_seed(process))
        elif step in regions:
            draws[step].append(_draw(regions[step]))
    return draws, process.get_state()


@pytest.mark.parametrize("order", ORDERS.values(), ids=ORDERS.keys())
def test_interleaved_forks_draw_as_each_alone_and_leave_the_process_its_draws(order: str) -> None:
    token = ComputeToken(0, SchedulePolicy("interleaved", 2, 2), 5.0, FreeOrdering())
    token.release(token.main)
    tasks = {"A": Task("leader", 0, "F", step=1), "B": Task("leader", 1, "F", step=1)}
    token.acquire(tasks["A"])
    holder = "A"
    regions: dict[str, contextlib.ExitStack] = {}
    draws: dict[str, list[list[float]]] = {"o": [], "A": [], "B": []}
    saved = torch.get_rng_state()
    torch.manual_seed(11)
    try:
        for step in order.split():
            if step.startswith(">"):
                token.enqueue(tasks[step[1]])
                token.release(tasks[holder])
                holder = step[1]
                token.await_token(tasks[holder])
            elif step == "o":
                draws["o"].append(_draw())
            elif step.endswith("+"):
                regions[step[0]] = contextlib.ExitStack()
                with token.running(tasks[step[0]]):
                    regions[step[0]].enter_context(forked(_seed()))
            elif step.endswith("-"):
                regions.pop(step[0]).close()
            else:
                draws[step].append(_draw())
        final = torch.get_rng_state()
    finally:
        torch.set_rng_state(saved)
    assert not tasks["A"].owned and not tasks["B"].owned
    expected, state = _replay(order)
    assert draws == expected
    assert torch.equal(final, state)


def test_a_fork_outside_tasks_is_a_plain_fork() -> None:
    saved = torch.get_rng_state()
    try:
        torch.manual_seed(3)
        with forked(9) as generators:
            inside = _draw()
        after = _draw()
    finally:
        torch.set_rng_state(saved)
    assert isinstance(generators, ForkedGenerators) and generators.away
    assert inside == _draw(torch.Generator().manual_seed(9))
    assert after == _draw(torch.Generator().manual_seed(3))


def test_forks_seed_the_cpu_and_their_own_gpus_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.manual_seed`` seeds every GPU too (queued until CUDA starts, where it has not),
    which a fork restores only for the GPUs it names: a region's or a distributed module's
    seed would then be every rank's GPU stream, and replicas seeded apart would draw the same
    dropout masks. On a CPU rank no GPU generator is touched."""
    gpus_seeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", gpus_seeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", gpus_seeded.append)
    rank = SimpleNamespace(config={"tensor_parallel_seed": 5}, device=torch.device("cpu"))
    monkeypatch.setattr(module.state, "current", lambda what=None: rank)
    monkeypatch.setattr(module, "_created", itertools.count())  # this module is the first
    saved = torch.get_rng_state()
    try:
        torch.manual_seed(3)
        gpus_seeded.clear()  # the script's own seed, for every device
        with forked(9):
            in_region = _draw()
        with module.seeded("smp.nn.DistributedLinear"):
            creating = _draw()
        after = _draw()
    finally:
        torch.set_rng_state(saved)
    assert gpus_seeded == []
    assert in_region == _draw(torch.Generator().manual_seed(9))
    assert creating == _draw(torch.Generator().manual_seed(5))
    assert after == _draw(torch.Generator().manual_seed(3))


@pytest.mark.gpu
def test_on_a_gpu_rank_a_modules_seed_is_forked_on_its_gpu_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A distributed module created on the GPU draws from the seed there; afterwards the GPU's
    stream goes on as if the module had not been made."""
    gpu = torch.device("cuda", 0)
    rank = SimpleNamespace(config={"tensor_parallel_seed": 5}, device=gpu)
    monkeypatch.setattr(module.state, "current", lambda what=None: rank)
    monkeypatch.setattr(module, "_created", itertools.count())
    torch.cuda.manual_seed(3)
    with module.seeded("smp.nn.DistributedLinear"):
        creating = torch.rand(3, device=gpu)
    after = torch.rand(3, device=gpu)
    assert torch.equal(
        creating, torch.rand(3, device=gpu, generator=torch.Generator(gpu).manual_seed(5))
    )
    torch.cuda.manual_seed(3)
    assert torch.equal(after, torch.rand(3, device=gpu))

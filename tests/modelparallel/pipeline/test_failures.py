"""A failure inside a partition is reported as itself: the rank, the type, the traceback."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import RemoteError
from tests.modelparallel.equivalence import init_smp
from tests.modelparallel.harness import run_ranks, sum_step


class _FailsOnThirdCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 3:
            raise KeyError("boom inside partition 1")
        return self.linear(x)


class _Chain(nn.Module):
    """``second`` takes ``first``'s output on partition 1: a deferred call refers to it."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.first = _FailsOnThirdCall()
        self.second = nn.Linear(4, 4)
        self.tail = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.tail(self.second(self.first(self.head(x))))


def _fail_in_partition_one() -> dict[str, Any]:
    dist.init_process_group("gloo")
    init_smp(2, "interleaved", microbatches=2, auto=False)
    module = _Chain()
    smp.set_partition(module.first, 1)
    smp.set_partition(module.second, 1)
    model = smp.DistributedModel(module)
    train = sum_step()

    seen: dict[str, Any] = {}
    try:
        for _ in range(2):  # the second step's calls are deferred (their outputs predicted)
            train(model, torch.randn(4, 4))
    except RemoteError as exc:
        seen = {"rank": exc.rank, "type": exc.exc_type, "traceback": exc.remote_traceback}
    smp.shutdown()
    dist.destroy_process_group()
    return seen


def test_an_error_in_a_module_on_partition_one_keeps_its_rank_type_and_traceback() -> None:
    for seen in run_ranks(2, _fail_in_partition_one, timeout=120):
        assert seen["rank"] == 1 and seen["type"] == "KeyError", seen
        assert 'raise KeyError("boom inside partition 1")' in seen["traceback"]


def _dispatch_breaks_on_partition_one() -> str:
    """Partition 1 cannot dispatch its requests (a fault in the runtime itself)."""
    from dtrain.modelparallel.pipeline.owner import Owner

    dist.init_process_group("gloo")
    init_smp(2, "interleaved", microbatches=2, auto=False)
    if smp.pp_rank() == 1:

        def broken(*_: Any) -> Any:
            raise RuntimeError("the owner cannot take this request")

        Owner.accept = broken  # type: ignore[method-assign]
    module = _Chain()
    smp.set_partition(module.first, 1)
    model = smp.DistributedModel(module)
    train = sum_step()

    try:
        train(model, torch.randn(4, 4))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        smp.shutdown()
        dist.destroy_process_group()
    return "no error"


def test_a_message_that_cannot_be_dispatched_fails_the_step_on_every_rank_naming_why() -> None:
    """Not a silent stall: the rank whose dispatch broke fails every wait for a reply, and the
    leader's step ends with the error."""
    for seen in run_ranks(2, _dispatch_breaks_on_partition_one, timeout=120):
        assert "the owner cannot take this request" in seen, seen

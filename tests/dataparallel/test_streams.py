"""Where the reducer issues its collectives on a GPU, checked on the CPU in a world of one.

On CUDA every stage of a bucket's reduction must be issued and waited for on the reducer's side
stream, after that stream waited for the bucket's gradients, and the compute stream must wait
for the side stream only once backward is over. A stand-in for :class:`SideStream` records
those calls, and where each collective was launched and waited for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtrain.dataparallel import reducer
from dtrain.dataparallel.compression import Codec
from dtrain.dataparallel.strategies import Transfer, private_buffers
from tests.dataparallel import scenarios

pytestmark = pytest.mark.timeout(60)

STAGES = 3


class RecordingSide:
    """What the reducer asked of its side stream, in order."""

    def __init__(self, device: torch.device) -> None:
        self.log: list[str] = []
        self.inside = False

    def wait_for_current(self) -> None:
        self.log.append("side waits for current")

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        outer, self.inside = self.inside, True
        try:
            yield
        finally:
            self.inside = outer

    def join(self) -> None:
        self.log.append("current waits for side")

    def used_on_side(self, tensor: torch.Tensor) -> None:
        self.log.append("bucket used on side")


class Spy:
    """A strategy of ``STAGES`` all-reduces (each a sum over the world of one) that records
    where each stage is launched and waited for."""

    num_stages = STAGES
    pad_multiple = 1
    buffers = staticmethod(private_buffers)

    def __init__(self) -> None:
        self.side: RecordingSide | None = None

    def launch(self, stage: int, transfer: Transfer) -> Any:
        assert self.side is not None
        self.side.log.append(f"launch {stage} on {'side' if self.side.inside else 'current'}")
        return SpyWork(dist.all_reduce(transfer.wire, async_op=True), self.side)


class SpyWork:
    def __init__(self, work: dist.Work, side: RecordingSide) -> None:
        self.work, self.side = work, side

    def wait(self) -> bool:
        self.side.log.append(f"wait on {'side' if self.side.inside else 'current'}")
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def test_collectives_go_to_the_side_stream_and_backward_waits_only_at_its_end(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sides: list[RecordingSide] = []

    def recording(device: torch.device) -> RecordingSide:
        sides.append(RecordingSide(device))
        return sides[-1]

    monkeypatch.setattr(reducer, "SideStream", recording)
    model = scenarios.mlp(scenarios.ROOT_SEED)
    strategy = Spy()
    named = list(model.named_parameters())
    cap = int(scenarios.CAP_MB * 2**20)
    reduce = reducer.Reducer(named, strategy, Codec(), dist.group.WORLD, cap, False, False)
    (side,) = sides
    strategy.side = side
    buckets = len(reduce.plan.buckets)
    assert buckets > 1 and side.log == ["bucket used on side"] * buckets
    side.log.clear()
    x, y = scenarios.batch(0, 0)
    F.mse_loss(model(x), y).backward()
    log = side.log
    assert log[-1] == "current waits for side" and log.count("current waits for side") == 1
    assert all(entry.endswith("on side") for entry in log if entry.startswith(("launch", "wait")))
    first_stages = [i for i, entry in enumerate(log) if entry == "launch 0 on side"]
    assert len(first_stages) >= buckets
    for index in first_stages:
        assert log[index - 1] == "side waits for current"  # for the chunk's gradients

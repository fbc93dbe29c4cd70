"""Manual placement: smp.partition contexts, smp.set_partition, and what the runtime reads back."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from torch import nn

import dtrain.modelparallel as smp
from dtrain.modelparallel import created, state
from dtrain.modelparallel.api import placement
from dtrain.modelparallel.errors import PartitionError
from tests.modelparallel.harness import single_process


@pytest.fixture(autouse=True)
def _forget_placements() -> Iterator[None]:
    yield
    placement.clear()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        with smp.partition(0):
            self.pinned = nn.ReLU()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(2, 2)
        with smp.partition(2):
            self.body = Block()
        with smp.partition(1):
            head = nn.Linear(2, 2)
        self.head = head  # assigned outside the context: creation is what counts


def test_modules_created_in_a_context_go_there_innermost_wins() -> None:
    with smp.partition(3):
        net = Net()
    assert placement.manual_placements(net) == {
        "": 3,
        "stem": 3,
        "body": 2,
        "body.inner": 2,
        "body.pinned": 0,
        "head": 1,
    }


def test_only_modules_created_inside_are_placed() -> None:
    outside = nn.Linear(2, 2)
    with smp.partition(1):
        wrapper = nn.Sequential(outside)
    assert placement.manual_placements(wrapper) == {"": 1}
    assert nn.Module.__init__ is created._original_init  # the wrapper is gone again


def test_other_threads_are_not_affected() -> None:
    made: list[nn.Module] = []
    entered, done = threading.Event(), threading.Event()

    def build() -> None:
        entered.wait(10)
        made.append(nn.Linear(1, 1))
        done.set()

    worker = threading.Thread(target=build)
    worker.start()
    with smp.partition(1):
        entered.set()
        done.wait(10)
    worker.join(10)
    assert placement.manual_placements(made[0]) == {}


def test_set_partition_recurses_and_overrides() -> None:
    with smp.partition(1):
        net = Net()
    smp.set_partition(net.body, 0)
    smp.set_partition(net, 3, recurse=False)
    placed = placement.manual_placements(net)
    assert placed["body"] == placed["body.inner"] == placed["body.pinned"] == 0
    assert placed[""] == 3 and placed["stem"] == 1


def test_indices_are_checked_against_the_pipeline_once_initialized() -> None:
    with pytest.raises(PartitionError, match="non-negative integer"):
        smp.set_partition(nn.ReLU(), -1)
    with smp.partition(5):  # before init the degree is unknown
        pass
    with single_process():
        with pytest.raises(PartitionError, match=r"partition 1 does not exist; allowed: 0 to 0"):
            smp.partition(1).__enter__()
        with pytest.raises(PartitionError, match=r"smp\.set_partition: partition 2"):
            smp.set_partition(nn.ReLU(), 2)
        with smp.partition(0):
            kept = nn.ReLU()
        assert placement.manual_placements(kept) == {"": 0}
        smp.reset()
        assert placement.manual_placements(kept) == {}
        state.register_model(Partitioned())
        with pytest.raises(PartitionError, match=r"before the first smp\.step"):
            smp.set_partition(kept, 0)


class Partitioned:
    partitioned = True

"""A stalled pipeline says which rank holds it up: every rank's waits, and who waits for nobody."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import CommunicationTimeoutError, RemoteError
from dtrain.modelparallel.pipeline.stall import RankState, StallWatch, Wait, WaitBoard, diagnose
from tests.modelparallel.equivalence import init_smp
from tests.modelparallel.harness import run_ranks

WAITING_ON_1 = (Wait(1, "forward request #3 for module 'b' (microbatch 0)", 0.0),)

CASES = {
    "a rank computing holds up the one waiting on it": (
        {
            0: RankState(0, "microbatch task F0 between computations", WAITING_ON_1),
            1: RankState(1, "served 'b' F0 computing 'b'"),
        },
        "rank 1 waits for nobody",
    ),
    "a rank that sent nothing is named when everyone else waits": (
        {0: RankState(0, "nothing computes", WAITING_ON_1)},
        "rank 1 sent no report",
    ),
    "ranks that wait on each other are a cycle": (
        {
            0: RankState(0, "nothing computes", WAITING_ON_1),
            1: RankState(1, "nothing computes", (Wait(0, "the end of step 2", 0.0),)),
        },
        "every rank waits for another (a cycle)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_diagnosis_names_who_holds_the_pipeline_up(case: str) -> None:
    states, verdict = CASES[case]
    report = diagnose([0, 1], states, silence=61.2)
    first, *rest = report.splitlines()
    assert first == f"pipeline stalled: nothing moved for 61 s; {verdict}"
    assert len([line for line in rest if line.startswith("  rank ")]) == 2
    if 0 in states:
        assert "    rank 1: forward request #3 for module 'b' (microbatch 0)" in rest


def test_the_board_lists_waits_in_progress_oldest_first() -> None:
    board = WaitBoard()
    with board.waiting(1, "first"):
        with board.waiting(2, "second"):
            assert [w.what for w in board.snapshot()] == ["first", "second"]
        assert [w.peer for w in board.snapshot()] == [1]
    assert board.snapshot() == ()


def test_a_rank_state_travels_as_text() -> None:
    state = RankState(3, "nothing computes", WAITING_ON_1)
    assert RankState.from_wire(state.to_wire()) == state


class _DictStore:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


def _started_watches(
    states: dict[int, RankState],
    silent_since: dict[int, float],
    in_step: Callable[[int], bool],
    published: list[str],
) -> list[StallWatch]:
    """Watches of ranks 0 and 1 (0.2 s limit) sharing one store, started."""
    store = _DictStore()
    watches = [
        StallWatch(
            r,
            [0, 1],
            0.2,
            lambda r=r: silent_since[r],
            lambda r=r: in_step(r),
            lambda r=r: states[r],
            store,
            published.append,
        )
        for r in (0, 1)
    ]
    for watch in watches:
        watch.start()
    return watches


def _wait_until(condition: Callable[[], bool], published: list[str]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, published
        time.sleep(0.05)


def test_two_watches_report_one_silence_once_through_a_store() -> None:
    published: list[str] = []
    since = time.monotonic()
    states = {0: RankState(0, "idle", WAITING_ON_1), 1: RankState(1, "computing 'b'")}
    watches = _started_watches(states, {0: since, 1: since}, lambda _: True, published)
    _wait_until(
        lambda: all(w.report is not None and "rank 1:" in w.report for w in watches), published
    )
    time.sleep(0.5)
    for watch in watches:
        watch.stop()
    assert len(published) == 2, "one report per rank and silence"
    assert all("rank 1 waits for nobody" in w.report for w in watches if w.report)
    # A timeout may cite a report of its own wait, not one older than the wait could be.
    assert watches[0].recent_report(within=60) == watches[0].report
    assert watches[0].recent_report(within=0.1) is None


def test_outside_a_step_a_rank_reports_nothing_but_shares_its_state() -> None:
    published: list[str] = []
    start = time.monotonic()
    states = {
        0: RankState(0, "microbatch task F0 between computations", WAITING_ON_1),
        1: RankState(1, "the main thread (outside the step)"),
    }
    # Rank 1's script has been busy since long before rank 0 entered the step (0.5 s from now,
    # more than the 0.2 s a report accepts): its state must still be fresh when rank 0 reports.
    silent_since = {0: start + 0.5, 1: start - 10}
    watches = _started_watches(states, silent_since, lambda r: r == 0, published)
    _wait_until(lambda: watches[0].report is not None, published)
    for watch in watches:
        watch.stop()
    assert len(published) == 1 and watches[1].report is None, published
    assert "rank 1 waits for nobody" in published[0]
    assert "rank 1: waits for nobody; the main thread (outside the step)" in published[0]


class _Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():  # the stalled step runs under no_grad
            time.sleep(6)
        return self.linear(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.slow = _Slow()

    def forward(self, x: Tensor) -> Tensor:
        return self.slow(self.head(x))


def _slow_on_partition_one(microbatches: int) -> smp.DistributedModel:
    """A world of two whose pipeline runs ``_Net.slow`` on partition 1."""
    dist.init_process_group("gloo")
    init_smp(2, "interleaved", microbatches, auto=False)
    module = _Net()
    smp.set_partition(module.slow, 1)
    return smp.DistributedModel(module)


def _stall_on_partition_one() -> str:
    model = _slow_on_partition_one(microbatches=1)

    @smp.step
    def forward(model: smp.DistributedModel, x: Tensor) -> Tensor:
        return model(x)

    forward(model, torch.ones(2, 4))
    error: Any = None
    try:
        with torch.no_grad():
            forward(model, torch.ones(2, 4))
    except (CommunicationTimeoutError, RemoteError) as exc:
        error = str(exc)
    time.sleep(3)  # the slow module has returned everywhere: the ranks stop together
    smp.shutdown()
    dist.destroy_process_group()
    return error


def test_a_stalled_step_fails_naming_the_rank_that_waits_for_nobody(
    capfd: pytest.CaptureFixture[str],
) -> None:
    env = {"DTRAIN_MP_STALL_REPORT": "1", "DTRAIN_MP_TIMEOUT": "4"}
    leader, _ = run_ranks(2, _stall_on_partition_one, timeout=60, env=env)
    assert leader is not None and re.search(r"no progress for 4 s|within 4 s", leader), leader
    assert "pipeline stalled: nothing moved for 1 s; rank 1 waits for nobody" in leader
    assert "rank 1: waits for nobody; served 'slow' F0 computing 'slow'" in leader
    assert "request #3 for module 'slow' (microbatch 0)" in leader  # what rank 0 waits for
    printed = capfd.readouterr().err
    assert "dtrain: rank 0: pipeline stalled" in printed
    assert "dtrain: rank 1: pipeline stalled" in printed


def _rest_between_steps() -> float:
    model = _slow_on_partition_one(microbatches=2)

    @smp.step
    def forward(model: smp.DistributedModel, x: Tensor) -> Tensor:
        return model(x).sum()

    forward(model, torch.ones(2, 4))
    time.sleep(4)  # longer than DTRAIN_MP_TIMEOUT: a checkpoint upload, say
    total = float(forward(model, torch.ones(2, 4)).reduce_mean())
    smp.shutdown()
    dist.destroy_process_group()
    return total


def test_a_pipeline_may_rest_between_steps_longer_than_the_timeout_and_the_report_limit(
    capfd: pytest.CaptureFixture[str],
) -> None:
    env = {"DTRAIN_MP_STALL_REPORT": "1", "DTRAIN_MP_TIMEOUT": "3"}
    leader, other = run_ranks(2, _rest_between_steps, timeout=60, env=env)
    assert leader == other
    assert "stalled" not in capfd.readouterr().err

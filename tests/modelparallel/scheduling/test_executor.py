"""The executor drives the scheduling core as the plan assumes: its threads and lock, without
processes (tasks sleep instead of computing)."""

from __future__ import annotations

import time

import pytest

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.pipeline.executor import Executor, Task
from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.ordering import FreeOrdering, PlannedOrdering
from dtrain.modelparallel.scheduling.planner import schedule_of
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.route import ORDER_ADVICE
from dtrain.modelparallel.transport.message import NOTICE, Message


def test_a_finished_backward_leaves_the_next_microbatch_admitted_before_the_token_moves() -> None:
    """Interleaved, 2 active: after B0 the next forward (F2) goes before the waiting terminal
    B1, as the plan has it; before, the backward gave the token to B1 as it ended."""
    policy = SchedulePolicy("interleaved", 6, 2)
    executor = Executor(0, policy, 5.0, FreeOrdering())

    def body(mb: int) -> None:
        with executor.computing("f"):
            time.sleep(0.02)
        with executor.backward(), executor.computing("b"):
            time.sleep(0.01)

    planned = [str(a) for a in schedule_of(policy, 1, Costs.of_stages([1.0])).compute_actions(0)]
    for _ in range(2):
        executor.clear_timeline()
        assert all(ok for ok, _ in executor.run_microbatches(6, body, 1))
        ran = [f"{e.kind}{e.microbatch}" for e in executor.timeline()]
        assert (
            ran
            == planned
            == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "F5", "B4", "B5"]
        )


def test_work_that_waits_inside_a_module_and_loses_its_turn_fails_naming_it() -> None:
    """With a plan order, a module whose child runs on another partition gives the token away
    while it waits; once the plan has moved on, its return fails naming it (it hung until the
    token's timeout before)."""
    plan = (("F", 0), ("F", 1), ("B", 0), ("B", 1))
    executor = Executor(0, SchedulePolicy("interleaved", 2, 2), 5.0, PlannedOrdering(plan, 0))
    executor.core.begin_step()
    executor.release(executor.main)
    first, second = Task("leader", 0, "F", step=1), Task("leader", 1, "F", step=1)
    executor.enqueue(first)
    executor.enqueue(second)
    executor.await_token(first)
    with executor._cv:  # as a leader task starts: holding, between computations
        executor.core.between(first)
    refused = pytest.raises(ModelParallelError, match=r"module 'parent' would compute")
    with (
        executor.running(first),
        refused as caught,
        executor.computing("parent"),
        executor.waiting(),
    ):
        assert second.granted.is_set()  # the plan moved on to F1 meanwhile
        with executor.running(second):
            executor.release(second)
    assert str(caught.value).endswith(ORDER_ADVICE)  # what to do about it


def test_a_weight_half_that_cannot_take_its_turn_fails_the_step_not_just_its_thread() -> None:
    """A weight half refused its turn (its action already over) raised on its pooled thread,
    where it was only printed: the step went on without its gradients. It now reaches the
    owner's failure, which fails the step; the half still counts as paid."""
    plan = (("F", 0), ("B", 0), ("W", 0))
    executor = Executor(1, SchedulePolicy("interleaved", 1, 1), 5.0, PlannedOrdering(plan, 1))
    executor.release(executor.main)
    executor.notices.heard(Message(NOTICE, 0, body="done", microbatch=0, step=1))
    half = Task("serve", 0, "W", "blocks.3", step=1)
    executor.owe_weights(half)
    failures: list[BaseException] = []
    executor.run_weights(half, lambda: None, failures.append)
    deadline = time.monotonic() + 5
    while executor.core.owes(1, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not executor.core.owes(1, 0)
    assert len(failures) == 1 and isinstance(failures[0], ModelParallelError)
    assert "module 'blocks.3' would compute on partition 1 after microbatch 0's weight half" in (
        str(failures[0])
    )

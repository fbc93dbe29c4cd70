"""The schedule's rules as tables, and the compute token following them, without threads."""

from __future__ import annotations

import pytest

from dtrain.modelparallel.executor import Executor, Task
from dtrain.modelparallel.policy import SchedulePolicy

# Waiting tasks (phase, microbatch) in the order they asked, and the order the token serves them.
HAND_OVER = [
    ("interleaved", ["F2", "B0", "F1", "B1"], ["B0", "B1", "F1", "F2"]),
    ("interleaved", ["F3", "F1", "F2"], ["F1", "F2", "F3"]),
    ("simple", ["F2", "B0", "F1", "B1"], ["B0", "B1", "F1", "F2"]),
    ("simple", ["B1", "F0"], ["F0", "B1"]),
]


def _task(text: str) -> Task:
    return Task("serve", int(text[1:]), phase=text[0])  # type: ignore[arg-type]


@pytest.mark.parametrize(("pipeline", "asked", "served"), HAND_OVER)
def test_the_token_goes_to_the_waiting_task_the_policy_ranks_first(
    pipeline: str, asked: list[str], served: list[str]
) -> None:
    executor = Executor(0, SchedulePolicy(pipeline, 4, 4), timeout=1.0)
    tasks = [_task(text) for text in asked]
    for task in tasks:
        executor.enqueue(task)  # the main task holds the token: everyone waits
    assert not any(task.granted.is_set() for task in tasks)
    served_tasks: list[Task] = []
    holder = executor.main
    for _ in tasks:
        executor.release(holder)
        holder = next(t for t in tasks if t.granted.is_set() and t not in served_tasks)
        executor.await_token(holder)
        served_tasks.append(holder)
    order = [f"{t.phase}{t.microbatch}" for t in served_tasks]
    assert order == served


def test_the_main_task_outranks_every_task() -> None:
    executor = Executor(0, SchedulePolicy("interleaved", 2, 2), timeout=1.0)
    executor.release(executor.main)
    backward = _task("B0")
    executor.enqueue(backward)
    assert backward.granted.is_set()
    executor.await_token(backward)
    executor.enqueue(executor.main)
    executor.enqueue(_task("B1"))
    executor.release(backward)
    assert executor.main.granted.is_set()


RULES = [
    # pipeline, microbatches, active, in flight → may admit, forwards done → backward may start
    ("simple", 4, 4, 3, True, 3, False),
    ("simple", 4, 4, 4, False, 4, True),
    ("interleaved", 4, 2, 1, True, 0, True),
    ("interleaved", 4, 2, 2, False, 1, True),
]


@pytest.mark.parametrize(
    ("pipeline", "microbatches", "active", "in_flight", "admit", "done", "backward"), RULES
)
def test_admission_and_the_backward_hold(
    pipeline: str,
    microbatches: int,
    active: int,
    in_flight: int,
    admit: bool,
    done: int,
    backward: bool,
) -> None:
    policy = SchedulePolicy(pipeline, microbatches, active)
    assert policy.may_admit(in_flight) is admit
    assert policy.backward_may_start(done) is backward


def test_only_the_last_microbatchs_backward_is_split_and_only_if_asked() -> None:
    policy = SchedulePolicy("interleaved", 4, 4)
    assert [policy.splits_backward(mb) for mb in range(4)] == [False, False, False, True]
    assert not SchedulePolicy("interleaved", 4, 4, split_backward=False).splits_backward(3)


def test_smps_rule_turns_a_bounded_simple_pipeline_into_interleaved() -> None:
    assert SchedulePolicy.for_config("simple", 8, 3).pipeline == "interleaved"
    assert SchedulePolicy.for_config("simple", 4, 6) == SchedulePolicy("simple", 4, 4)
    with pytest.raises(ValueError, match="did you mean 'simple'"):
        SchedulePolicy("simpel", 4, 4)
    with pytest.raises(ValueError, match="active microbatches: got 5; allowed: 1 to 4"):
        SchedulePolicy("interleaved", 4, 5)

"""The schedule's rules as tables, and the compute token following them, without threads."""

from __future__ import annotations

import pytest

from dtrain.modelparallel.pipeline.executor import Executor, Task
from dtrain.modelparallel.scheduling.ordering import FreeOrdering
from dtrain.modelparallel.scheduling.policy import SchedulePolicy

# Waiting tasks (phase, microbatch) in the order they asked, and the order the token serves them.
HAND_OVER = [
    ("interleaved", ["F2", "B0", "F1", "B1"], ["B0", "B1", "F1", "F2"]),
    ("interleaved", ["F3", "F1", "F2"], ["F1", "F2", "F3"]),
    ("interleaved", ["W3", "F2", "W1", "I1"], ["I1", "F2", "W1", "W3"]),
    ("simple", ["F2", "B0", "F1", "B1"], ["F1", "F2", "B0", "B1"]),
    ("simple", ["B1", "F0"], ["F0", "B1"]),
    ("simple", ["W0", "B1", "F3"], ["F3", "B1", "W0"]),
]


def _task(text: str) -> Task:
    return Task("serve", int(text[1:]), phase=text[0])  # type: ignore[arg-type]


@pytest.mark.parametrize(("pipeline", "asked", "served"), HAND_OVER)
def test_the_token_goes_to_the_waiting_task_the_policy_ranks_first(
    pipeline: str, asked: list[str], served: list[str]
) -> None:
    executor = Executor(0, SchedulePolicy(pipeline, 4, 4), 1.0, FreeOrdering())
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
    executor = Executor(
        0, SchedulePolicy("interleaved", 2, 2), timeout=1.0, ordering=FreeOrdering()
    )
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


def test_a_terminal_backward_goes_after_forwards_in_interleaved_only() -> None:
    """The leader's backward that no other rank waits for any more yields to forward work,
    which feeds the other stages; ``simple`` runs forwards first anyway."""
    interleaved, simple = SchedulePolicy("interleaved", 4, 4), SchedulePolicy("simple", 4, 4)
    assert interleaved.priority("B", 0, terminal=True) > interleaved.priority("F", 3)
    assert interleaved.priority("B", 0, terminal=True) < interleaved.priority("W", 0)
    assert interleaved.priority("B", 3) < interleaved.priority("F", 0)
    assert simple.priority("B", 0, terminal=True) == simple.priority("B", 0)
    task = Task("leader", 2, phase="B")
    task.remote_nodes[1] += 1  # a value fetched from partition 1 whose backward is to come
    assert not task.terminal
    task.remote_nodes[1] -= 1
    assert task.terminal and not Task("serve", 2, phase="B").terminal


def test_the_step_s_last_backwards_are_split_as_many_per_stage_as_the_policy_says() -> None:
    policy = SchedulePolicy("interleaved", 4, 4, split=(0, 2))
    assert [policy.splits_backward(1, mb) for mb in range(4)] == [False, False, True, True]
    assert not any(policy.splits_backward(stage, mb) for stage in (0, 2) for mb in range(4))
    assert not any(SchedulePolicy("interleaved", 4, 4).splits_backward(1, mb) for mb in range(4))
    with pytest.raises(ValueError, match=r"split backwards per stage: got \(0, 5\)"):
        SchedulePolicy("interleaved", 4, 4, split=(0, 5))


def test_the_main_task_waits_for_the_weight_halves_due() -> None:
    """At a step's end the main task (the optimizer step comes next) is queued first; the weight
    halves still due run before it, and nothing else does (a request of the next step waits)."""
    executor = Executor(
        0, SchedulePolicy("interleaved", 2, 2), timeout=1.0, ordering=FreeOrdering()
    )
    executor.release(executor.main)
    weights, next_step = _task("W1"), _task("F0")
    executor.owe_weights(weights)
    executor.enqueue(executor.main)
    executor.enqueue(next_step)
    assert executor.main.granted.is_set() is False and next_step.granted.is_set() is False
    executor.enqueue(weights)
    assert weights.granted.is_set()
    executor.await_token(weights)
    executor.release(weights)
    assert not executor.main.granted.is_set()  # still due until it says it has run
    executor.notices.weights_paid(weights)
    assert executor.main.granted.is_set() and not next_step.granted.is_set()


def test_a_weight_half_that_fails_is_paid_and_the_main_task_goes_on() -> None:
    """The half's task pays its debt however it ends: a failure goes to the owner (it fails the
    step), not to the wait for the token."""
    executor = Executor(
        1, SchedulePolicy("interleaved", 2, 2), timeout=1.0, ordering=FreeOrdering()
    )
    executor.release(executor.main)
    weights = Task("serve", 1, "W", "layer")
    executor.owe_weights(weights)
    executor.enqueue(executor.main)
    assert not executor.main.granted.is_set()

    def fail() -> None:
        raise RuntimeError("weights failed")

    failures: list[BaseException] = []
    executor._weights_task(weights, fail, failures.append)  # run_weights' pooled thread's
    assert [str(f) for f in failures] == ["weights failed"]
    assert executor.main.granted.is_set() and not executor.core.weights_owed


def test_smps_rule_turns_a_bounded_simple_pipeline_into_interleaved() -> None:
    assert SchedulePolicy.for_config("simple", 8, 3).pipeline == "interleaved"
    assert SchedulePolicy.for_config("simple", 4, 6) == SchedulePolicy("simple", 4, 4)
    with pytest.raises(ValueError, match="did you mean 'simple'"):
        SchedulePolicy("simpel", 4, 4)
    with pytest.raises(ValueError, match="active microbatches: got 5; allowed: 1 to 4"):
        SchedulePolicy("interleaved", 4, 5)


def test_a_task_dispatched_first_computes_first_even_if_its_thread_starts_later() -> None:
    """Forwards of two microbatches reach a rank in order; if the second's thread asked for a
    free token first it would compute first (BatchNorm's running statistics would then differ
    from one process's). An announced task keeps its place; one that never computes gives it
    up."""
    executor = Executor(1, SchedulePolicy("simple", 4, 4), 1.0, FreeOrdering())
    executor.release(executor.main)
    first, second, fetch_only = _task("F0"), _task("F1"), _task("F2")
    for task in (fetch_only, first, second):
        executor.announce(task)
    executor.enqueue(second)
    assert not second.granted.is_set()  # the token is free, but F0 is ahead in line
    with executor.serving(fetch_only):  # a stream that never computes
        pass
    assert not second.granted.is_set()
    executor.enqueue(first)
    assert first.granted.is_set() and not second.granted.is_set()
    executor.await_token(first)
    executor.release(first)
    assert second.granted.is_set()
    interleaved = Executor(
        1, SchedulePolicy("interleaved", 4, 4), timeout=1.0, ordering=FreeOrdering()
    )
    interleaved.release(interleaved.main)
    later, urgent = _task("F3"), _task("B1")
    interleaved.announce(later)
    interleaved.enqueue(urgent)  # dispatched after it, but more urgent: it does not wait
    assert urgent.granted.is_set()

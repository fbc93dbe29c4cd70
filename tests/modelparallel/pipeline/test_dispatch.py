"""The dispatcher's rules without processes: the step gate as tables, the thread's order and
its failures."""

from __future__ import annotations

import threading

import pytest

from dtrain.modelparallel.pipeline.dispatch import Dispatcher, StepGate

# Arrivals: ("req", step) is a request stream of the leader's step, ("end", step) its end here.
# Served: the requests in the order they may be served.
GATE = [
    ([("req", 1), ("end", 1), ("req", 2)], ["1", "2"]),
    ([("req", 1), ("req", 2), ("end", 1)], ["1", "2"]),  # step 2 began before step 1 ended
    ([("req", 1), ("req", 2), ("req", 3), ("end", 1), ("end", 2)], ["1", "2", "3"]),
    ([("req", 3), ("req", 2), ("end", 1), ("end", 2)], ["2", "3"]),  # kept in arrival order
    ([("end", 1), ("req", 2), ("req", 2)], ["2", "2"]),  # the step after the last end is due
]


@pytest.mark.parametrize(("arrivals", "served"), GATE)
def test_a_request_of_a_later_step_waits_for_the_end_of_the_one_before(
    arrivals: list[tuple[str, int]], served: list[str]
) -> None:
    gate: StepGate[str] = StepGate()
    order: list[str] = []
    for kind, step in arrivals:
        if kind == "end":
            order += gate.end(step)
        elif gate.admit(step, str(step)):
            order.append(str(step))
    assert order == served
    assert not gate.early


def test_the_dispatcher_hands_streams_over_in_order_and_survives_a_failing_one() -> None:
    handled: list[int] = []
    failures: list[BaseException] = []
    done = threading.Event()

    def handle(stream: int) -> None:
        if stream == 2:
            raise ValueError("a bug")
        handled.append(stream)
        if stream == 4:
            done.set()

    dispatcher: Dispatcher[int] = Dispatcher("test-dispatch", handle, failures.append)
    for stream in range(5):
        dispatcher.put(stream)
    assert done.wait(10)
    dispatcher.close(10)
    assert handled == [0, 1, 3, 4]
    assert [str(e) for e in failures] == ["a bug"]

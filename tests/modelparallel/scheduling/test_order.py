"""The plan's order on one rank, as tables: which action may compute, and when the next one
does."""

from __future__ import annotations

import pytest

from dtrain.modelparallel.scheduling.order import PlanOrder


def _order(text: str) -> PlanOrder:
    return PlanOrder.of((word[0], int(word[1:])) for word in text.split())


# Plan, actions ended (in this order), then what may compute.
TURNS = [
    ("F0 F1 B0 F2 B1 B2", [], "F0"),
    ("F0 F1 B0 F2 B1 B2", ["F0"], "F1"),
    ("F0 F1 B0 F2 B1 B2", ["F1"], "F0"),  # ended early: its turn passes once F0 has ended
    ("F0 F1 B0 F2 B1 B2", ["F1", "F0"], "B0"),
    ("F0 I0 F1 I1 W0 W1", ["F0", "I0", "F1"], "B1"),  # an input half is the backward
    ("F0 I0 F1 I1 W0 W1", ["F0", "B0", "F1", "B1", "W0"], "W1"),
    ("F0 B0", ["F0", "B0"], "-"),
]


@pytest.mark.parametrize(("plan", "ended", "current"), TURNS)
def test_only_the_current_action_may_compute(plan: str, ended: list[str], current: str) -> None:
    order = _order(plan)
    for action in ended:
        order.end(action[0], int(action[1:]))
        order.advance()
    shown = "-" if order.current is None else f"{order.current[0]}{order.current[1]}"
    assert shown == current
    for phase, mb in {(a[0], a[1]) for a in order.actions}:
        assert order.admits(phase, mb) is (order.current == (phase, mb, 0))
    if current.startswith("B"):
        assert order.admits("I", int(current[1:]))


def test_an_ended_action_is_known_and_described() -> None:
    order = _order("F0 B0 F1 B1")
    order.end("F", 0)
    order.advance()
    assert order.has_ended("F", 0) and not order.has_ended("B", 0)
    assert order.describe() == "B0"
    for action in ("B0", "F1", "B1"):
        order.end(action[0], int(action[1:]))
    order.advance()
    assert order.describe() == "every action of the plan ended"


# Plan, actions said to be over, actions with work still here -> what may compute.
BUSY = [
    ("F0 F1 B0", ["F0"], ["F0"], "F0"),  # the notice came before its work ran: F0 stays
    ("F0 F1 B0", ["F0"], [], "F1"),
    ("F0 F1 B0", ["F0", "F1"], ["F1"], "F1"),  # ended ahead of its turn, its work still here
    ("F0 F1 B0", ["F1"], ["F0"], "F0"),  # work of an action not over keeps it anyway
]


@pytest.mark.parametrize(("plan", "ended", "busy", "current"), BUSY)
def test_an_ended_action_passes_only_once_its_work_here_has_run(
    plan: str, ended: list[str], busy: list[str], current: str
) -> None:
    order = _order(plan)
    for action in ended:
        order.end(action[0], int(action[1:]))
    order.advance(lambda key: f"{key[0]}{key[1]}" in busy)
    assert order.describe() == current
    assert order.has_ended("F", 0) is (current != "F0")


def test_a_microbatch_that_comes_back_has_an_action_per_visit() -> None:
    """A head tied to the embedding: the leader's forward of a microbatch visits it twice
    (before and after the other partitions), its backward twice in reverse; each visit is an
    action of its own, and ending the forward or backward as a whole ends every visit."""
    order = PlanOrder.of([("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)])
    assert order.admits("F", 0) and not order.admits("F", 0, 1)
    order.end("F", 0, 0)
    order.advance()
    assert order.admits("F", 1) and order.has("F", 0, 1) and not order.has("F", 1, 1)
    order.end("F", 1)
    order.advance()
    assert order.describe() == "F0 (visit 1)" and order.has_ended("F", 0, 0)
    order.end("F", 0)  # the task turned to its backward: every visit of its forward is over
    order.advance()
    assert order.admits("I", 0, 1)
    order.end("B", 0, 1)
    order.advance()
    assert order.describe() == "B0"

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
        assert order.admits(phase, mb) is (order.current == (phase, mb))
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

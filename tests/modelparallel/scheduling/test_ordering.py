"""The orderings' notices as tables: what each runtime event tells, to this rank's core or to
the others, with no threads, processes or model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dtrain.modelparallel.scheduling.order import PlanRow
from dtrain.modelparallel.scheduling.ordering import (
    FreeOrdering,
    Notice,
    Ordering,
    PlannedOrdering,
    ordering_for,
)
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.schedule import Action, Schedule
from dtrain.modelparallel.scheduling.scheduler import Scheduler, Work

ROW: PlanRow = (("F", 0), ("F", 1), ("B", 0), ("W", 0), ("B", 1), ("W", 1))


class Told:
    """A :class:`~dtrain.modelparallel.scheduling.ordering.Tell` that records what it is told,
    changing its core as the runtime would."""

    def __init__(self, ordering: Ordering) -> None:
        self.core = Scheduler(SchedulePolicy("interleaved", 2, 2), ordering)
        self.told: list[str] = []

    def here(self, change: Callable[[Scheduler], bool]) -> None:
        self.told.append(f"here {change(self.core)}")

    def ask(self, question: Callable[[Scheduler], Any]) -> Any:
        return question(self.core)

    def peers(self, work: Work, notice: Notice) -> None:
        self.told.append(f"peers {notice} {work.microbatch}")

    def after_queued(self, work: Work, partition: int, notice: Notice) -> None:
        self.told.append(f"partition {partition} {notice} {work.microbatch}")


def _leader(phase: str = "F", microbatch: int = 0) -> Work:
    return Work("leader", microbatch, phase)  # type: ignore[arg-type]


# Event, then what a planned ordering (of rank 1, or of the leader where the event is its)
# tells; the free ordering tells nothing for any of them.
EVENTS: list[tuple[str, Callable[[Ordering, Told], Any], list[str]]] = [
    ("first call", lambda o, t: o.moved_on(t, _leader(), 1), []),
    (
        "moved on",
        lambda o, t: [o.moved_on(t, work := _leader(), 1), o.moved_on(t, work, 2)],
        ["partition 1 forward 0"],
    ),
    (
        "called again",
        lambda o, t: [o.moved_on(t, work := _leader(), 1), o.moved_on(t, work, 1)],
        [],
    ),
    ("a backward calls", lambda o, t: o.moved_on(t, _leader("B"), 1), []),
    ("forward over", lambda o, t: o.forward_over(t, _leader()), ["peers forward 0"]),
    ("microbatch over", lambda o, t: o.microbatch_over(t, _leader()), ["peers done 0"]),
    ("last backward", lambda o, t: o.backward_over(t, 0, 0), ["here True"]),
    ("heard forward", lambda o, t: o.heard(t, "forward", 0, 0), ["here True"]),
    ("heard done", lambda o, t: o.heard(t, "done", 0, 0), ["here True"]),
    ("leader waits", lambda o, t: o.waits(t, _leader(), False), ["here True"]),
    ("served waits", lambda o, t: o.waits(t, Work("serve", 0, "F"), False), ["here False"]),
    ("comes back", lambda o, t: o.comes_back(t, _leader()), ["here False"]),
    ("placing", lambda o, t: o.placing(t, _leader()), []),
]


@pytest.mark.parametrize(("event", "happen", "told"), EVENTS, ids=[e[0] for e in EVENTS])
def test_what_each_event_tells(
    event: str, happen: Callable[[Ordering, Told], Any], told: list[str]
) -> None:
    free = FreeOrdering()
    free_told = Told(free)
    happen(free, free_told)
    assert free_told.told == []
    planned = PlannedOrdering(ROW, 1)
    planned_told = Told(planned)
    happen(planned, planned_told)
    assert planned_told.told == told


def test_what_a_notice_ends_on_the_rank_that_hears_it() -> None:
    """``forward``: the rank's forward of the microbatch; ``done``: all its work of it (its
    weight half unless one is still owed)."""
    ordering = PlannedOrdering(ROW, 1)
    told = Told(ordering)
    ordering.heard(told, "forward", 0, 0)
    assert ordering.order(0).describe() == "F1"
    told.core.owe(0, 0)
    ordering.heard(told, "done", 0, 0)
    ordering.heard(told, "forward", 0, 1)
    assert ordering.order(0).describe() == "W0"
    told.core.paid(0, 0)
    assert ordering.order(0).describe() == "B1"


def test_a_forward_come_back_to_the_leader_is_told_to_the_others() -> None:
    """Placed to compute again after its visit ended, the leader's forward is its next
    visit's: it will not compute on another rank any more, which every other rank learns."""
    ordering = PlannedOrdering((("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)), 0)
    told, work = Told(ordering), _leader()
    told.core.computes(work)
    ordering.waits(told, work, False)
    assert ordering.placing(told, work) is None
    assert work.visit == 1 and told.told == ["here True", "peers forward 0"]


def test_work_the_plan_cannot_order_is_placed_nowhere() -> None:
    ordering = PlannedOrdering(ROW, 0)
    where = ordering.placing(Told(ordering), Work("serve", 0, "F"))
    assert where == "on partition 0, called from another partition"
    assert FreeOrdering().placing(Told(FreeOrdering()), Work("serve", 0, "F")) is None


def test_the_ordering_is_chosen_once_per_rank_from_the_plan() -> None:
    plan = Schedule("interleaved", 1, 1, 1, ((Action("F", 0, 0), Action("B", 0, 0)),))
    planned = ordering_for(plan, 0, planned=True)
    assert isinstance(planned, PlannedOrdering) and planned.row == (("F", 0, 0), ("B", 0, 0))
    assert isinstance(ordering_for(plan, 0, planned=False), FreeOrdering)

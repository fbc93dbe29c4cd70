"""The runtime's one place for "this action is over": what each event costs under each ordering
(the core's lock, messages to the other ranks), without threads, processes or a model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.pipeline.notices import Notices
from dtrain.modelparallel.scheduling.ordering import FreeOrdering, Ordering, PlannedOrdering
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.scheduler import Scheduler, Work
from dtrain.modelparallel.transport.message import NOTICE, Message


class Rank:
    """A core behind a counted lock, and the messages that would leave the rank."""

    def __init__(self, ordering: Ordering) -> None:
        self.core = Scheduler(SchedulePolicy("interleaved", 2, 2), ordering)
        self.locked = 0
        self.sent: list[str] = []
        self.notices = Notices(self, ordering, self)

    def decide(self, change: Callable[[Scheduler], bool | None]) -> None:
        self.locked += 1
        change(self.core)

    def ask(self, question: Callable[[Scheduler], Any]) -> Any:
        self.locked += 1
        return question(self.core)

    def to_peers(self, work: Work, message: Message) -> None:
        self.sent.append(f"peers {message.body} {message.microbatch}")

    def queue_for(self, work: Work, partition: int, message: Message) -> None:
        self.sent.append(f"partition {partition} {message.body} {message.microbatch}")


def _notice(body: str, microbatch: int = 0) -> Message:
    return Message(NOTICE, 0, body=body, microbatch=microbatch, step=0)


def _leader() -> Work:
    return Work("leader", 0, "F")


# Event -> (locks, messages) under the free ordering, then under a planned one (rank 1's row).
EVENTS: list[tuple[str, Callable[[Notices], Any], tuple[int, int], tuple[int, int]]] = [
    ("a call", lambda n: n.moved_on(_leader(), 1), (0, 0), (0, 0)),
    (
        "the next partition's call",
        lambda n: [n.moved_on(work := _leader(), 1), n.moved_on(work, 2)],
        (0, 0),
        (0, 1),
    ),
    ("forward over", lambda n: n.forward_over(_leader()), (1, 0), (2, 1)),
    ("microbatch over", lambda n: n.microbatch_over(_leader()), (0, 0), (0, 1)),
    ("last backward", lambda n: n.backward_over(0, 0), (0, 0), (1, 0)),
    ("a wait", lambda n: n.waits(_leader()), (0, 0), (1, 0)),
    ("back from replies", lambda n: n.comes_back(_leader()), (0, 0), (1, 0)),
    ("about to compute", lambda n: n.placing(Work("serve", 0, "F"), "m"), (0, 0), (1, 0)),
    ("a notice", lambda n: n.heard(_notice("forward")), (0, 0), (1, 0)),
]


@pytest.mark.parametrize(("event", "happen", "free", "planned"), EVENTS, ids=[e[0] for e in EVENTS])
def test_under_the_free_ordering_an_event_costs_no_lock_and_no_message(
    event: str,
    happen: Callable[[Notices], Any],
    free: tuple[int, int],
    planned: tuple[int, int],
) -> None:
    """Only the leader's hold needs to know a forward is over; a planned ordering hears every
    event, and tells the others what it ends there."""
    for ordering, expected in ((FreeOrdering(), free), (PlannedOrdering((("F", 0),), 1), planned)):
        rank = Rank(ordering)
        happen(rank.notices)
        assert (rank.locked, len(rank.sent)) == expected, type(ordering).__name__


def test_a_paid_weight_half_is_told_under_either_ordering() -> None:
    for ordering in (FreeOrdering(), PlannedOrdering((("W", 0),), 1)):
        rank = Rank(ordering)
        rank.core.owe(0, 0)
        rank.notices.weights_paid(Work("serve", 0, "W"))
        assert not rank.core.owes(0, 0) and rank.locked == 1


def test_what_the_others_are_told_and_what_a_notice_ends() -> None:
    leader = Rank(PlannedOrdering((("F", 0), ("B", 0)), 0))
    leader.notices.forward_over(_leader())
    leader.notices.microbatch_over(_leader())
    assert leader.sent == ["peers forward 0", "peers done 0"]
    assert leader.core.forwards_done == {0}
    other = Rank(ordering := PlannedOrdering((("F", 0), ("B", 0), ("F", 1)), 1))
    other.notices.heard(_notice("forward"))
    assert ordering.order(0).describe() == "B0"
    other.notices.heard(_notice("done"))
    assert ordering.order(0).describe() == "F1"
    with pytest.raises(ModelParallelError, match="unknown notice 'later'"):
        other.notices.heard(_notice("later"))


def test_work_the_plan_cannot_order_fails_naming_the_module() -> None:
    rank = Rank(PlannedOrdering((("F", 0),), 0))
    with pytest.raises(ModelParallelError, match=r"module 'head' would compute on partition 0,"):
        rank.notices.placing(Work("serve", 0, "F"), "head")

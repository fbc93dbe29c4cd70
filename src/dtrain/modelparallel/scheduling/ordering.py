"""Whose turn it is on a rank: the scheduling core's ordering, a strategy chosen once per rank.

* :class:`FreeOrdering` (the default): every work is in turn; the compute token goes to
  whichever waiting work the policy ranks first, so the order follows the times work becomes
  ready (and may differ between data-parallel replicas).
* :class:`PlannedOrdering` (``deterministic_server``, and tensor parallelism, whose ranks must
  run their collectives in one order): a work is in turn only while its action is the rank's
  current one in its plan row (:mod:`.order`), the same on every replica.

An ordering answers the core's questions (:class:`~.scheduler.Turns`, under the core's lock)
and hears the runtime's events: a planned ordering's turn passes once its action is over, and
what ends an action may happen on another rank (the leader's forward moving on, its task
ending). What an event ends, and who must learn it, is the ordering's to say; it says it
through a :class:`Tell`: the runtime's :mod:`..pipeline.notices` (its core's lock, messages
to the other ranks) or the runtime model (:mod:`.runtime_model`, over simulated time). The
free ordering has nothing to learn: its events cost a call that does nothing, no lock and no
message.

Plain data: the rules are tested as tables, without threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol, TypeVar

from dtrain.modelparallel.scheduling.order import PlanOrder, PlanRow, action_key
from dtrain.modelparallel.scheduling.rules import is_gradient
from dtrain.modelparallel.scheduling.scheduler import Busy, Scheduler, Turns, Work

T = TypeVar("T")

Notice = Literal["forward", "done"]
"""What another rank learns of a microbatch: its forward there is over (``forward``), or all
its work there, the leader's task having ended (``done``)."""

NOTICES: tuple[Notice, ...] = ("forward", "done")


class PlanRows(Protocol):
    """A plan that gives each rank its row (:class:`~.schedule.Schedule`,
    :class:`~.route.RouteSchedule`)."""

    def plan_row(self, rank: int) -> PlanRow: ...


class Tell(Protocol):
    """How an ordering's notices reach a core: this rank's, or another rank's."""

    def here(self, change: Callable[[Scheduler], bool]) -> None:
        """Change this rank's core (under its lock); ``change`` says whether the token may go
        on."""

    def ask(self, question: Callable[[Scheduler], T]) -> T:
        """Read this rank's core (under its lock)."""

    def peers(self, work: Work, notice: Notice) -> None:
        """Every other rank learns ``notice`` of ``work``'s microbatch, after the requests
        ``work`` queued."""

    def after_queued(self, work: Work, partition: int, notice: Notice) -> None:
        """Partition ``partition`` learns ``notice`` of ``work``'s microbatch after the requests
        ``work`` queued for it (their turn passes once they have run there)."""


class Ordering(Turns, Protocol):
    """The core's questions (:class:`~.scheduler.Turns`) and the runtime's events: what each
    event ends, told through ``tell``. The events come outside the core's lock."""

    def moved_on(self, tell: Tell, work: Work, partition: int) -> None:
        """The leader's ``work`` calls partition ``partition``."""

    def forward_over(self, tell: Tell, work: Work) -> None:
        """The leader's ``work`` turned to its backward (its own forward action here has ended
        with :meth:`.Scheduler.forward_over`)."""

    def microbatch_over(self, tell: Tell, work: Work) -> None:
        """The leader's ``work`` (its microbatch's step body) is over."""

    def backward_over(self, tell: Tell, step: int, microbatch: int) -> None:
        """The microbatch's last backward on this rank has run."""

    def heard(self, tell: Tell, notice: Notice, step: int, microbatch: int) -> None:
        """Another rank's notice arrived."""

    def waits(self, tell: Tell, work: Work, reply: bool) -> None:
        """``work`` waits for another rank (for a call's ``reply`` only to learn its outputs'
        structure: see :meth:`PlannedOrdering.visit_over`)."""

    def comes_back(self, tell: Tell, work: Work) -> None:
        """``work``, which waited for replies since it computed last, computes here again."""

    def placing(self, tell: Tell, work: Work) -> str | None:
        """``work`` is about to ask for the token to compute: where it would compute that the
        ordering cannot order (None: nowhere)."""

    def visit_missed(self, tell: Tell, work: Work) -> str | None:
        """Why the leader's forward ``work`` may not turn to its backward (None: it may)."""


class FreeOrdering:
    """Every work is in turn: the token follows the policy's priority among the work that
    waits. No action ends, so there is nothing to tell."""

    def watch(self, busy: Busy) -> None:
        pass

    def in_turn(self, work: Work) -> bool:
        return True

    def end(self, step: int, phase: str, microbatch: int, visit: int | None = None) -> bool:
        return False

    def ended(self, step: int, phase: str, microbatch: int, visit: int = 0) -> bool:
        return False

    def own_action_ended(self, work: Work) -> bool:
        return False

    def describe_turn(self) -> str:
        return ""

    def moved_on(self, tell: Tell, work: Work, partition: int) -> None:
        pass

    def forward_over(self, tell: Tell, work: Work) -> None:
        pass

    def microbatch_over(self, tell: Tell, work: Work) -> None:
        pass

    def backward_over(self, tell: Tell, step: int, microbatch: int) -> None:
        pass

    def heard(self, tell: Tell, notice: Notice, step: int, microbatch: int) -> None:
        pass

    def waits(self, tell: Tell, work: Work, reply: bool) -> None:
        pass

    def comes_back(self, tell: Tell, work: Work) -> None:
        pass

    def placing(self, tell: Tell, work: Work) -> str | None:
        return None

    def visit_missed(self, tell: Tell, work: Work) -> str | None:
        return None


class PlannedOrdering:
    """A rank's compute in its plan row's order (see :mod:`.order`): work computes only while
    its action is the current one; an action passes once it has been said over and no work of
    it is left on the rank.

    The leader's forward of a microbatch is over on a rank when the forward moves on from it
    (the leader calls the next partition) or turns to its backward; its backward there with
    the microbatch's last backward request; the leader's own actions of it when its task waits
    for another rank or ends (:meth:`visit_over`)."""

    def __init__(self, row: PlanRow, rank: int) -> None:
        """``row``: rank ``rank``'s compute actions, in the order every step runs them."""
        self.row = row
        self.rank = rank
        self._orders: dict[int, PlanOrder] = {}
        self._busy: Busy = lambda step, key: False

    # --- the core's questions -------------------------------------------------------------------

    def watch(self, busy: Busy) -> None:
        self._busy = busy

    def order(self, step: int) -> PlanOrder:
        """The plan's order for ``step``, moved on past every ended action no work here still
        belongs to; the orders of steps two or more before are dropped."""
        order = self._orders.get(step)
        if order is None:
            order = self._orders[step] = PlanOrder.of(self.row)
            for old in [s for s in self._orders if s < step - 1]:
                del self._orders[old]
        order.advance(lambda key: self._busy(step, key))
        return order

    def in_turn(self, work: Work) -> bool:
        if work.role == "main":
            return True
        return self.order(work.step).admits(work.phase, work.microbatch, work.visit)

    def end(self, step: int, phase: str, microbatch: int, visit: int | None = None) -> bool:
        self.order(step).end(phase, microbatch, visit)
        return True

    def ended(self, step: int, phase: str, microbatch: int, visit: int = 0) -> bool:
        return self.order(step).has_ended(phase, microbatch, visit)

    def own_action_ended(self, work: Work) -> bool:
        if work.role == "main":
            return False
        key = action_key(work.phase, work.microbatch, work.visit)
        return key in self.order(work.step).ended

    def describe_turn(self) -> str:
        """The current action in the latest step begun here."""
        if not self._orders:
            return ""
        step = max(self._orders)
        return f"{self.order(step).describe()} of step {step}"

    # --- the runtime's events -------------------------------------------------------------------

    def moved_on(self, tell: Tell, work: Work, partition: int) -> None:
        """The partition the leader's forward called before learns that its forward of the
        microbatch is over (after the requests queued for it; its turn passes once they have
        run). Its next forward need not wait for the whole forward to end, which would make it
        wait for the later partitions' turns: with three partitions or more, a deadlock. A
        call that comes back later fails as off the plan."""
        if work.role != "leader" or work.phase != "F":
            return
        before, work.called = work.called, partition
        if before is not None and before != partition:
            tell.after_queued(work, before, "forward")

    def forward_over(self, tell: Tell, work: Work) -> None:
        tell.peers(work, "forward")

    def microbatch_over(self, tell: Tell, work: Work) -> None:
        tell.peers(work, "done")

    def backward_over(self, tell: Tell, step: int, microbatch: int) -> None:
        tell.here(lambda core: core.end_backward(step, microbatch))

    def heard(self, tell: Tell, notice: Notice, step: int, microbatch: int) -> None:
        if notice == "forward":
            tell.here(lambda core: self.end(step, "F", microbatch))
        else:
            tell.here(lambda core: core.end_microbatch(step, microbatch))

    def waits(self, tell: Tell, work: Work, reply: bool) -> None:
        tell.here(lambda core: self.visit_over(work, reply))

    def comes_back(self, tell: Tell, work: Work) -> None:
        tell.here(lambda core: self.back_from_replies(work))

    def placing(self, tell: Tell, work: Work) -> str | None:
        """Work that comes back after it waited is its next visit's, if the plan has one
        (:meth:`returns`): a forward come back to its last visit on the leader is over on
        every other rank, which learns it; work the plan cannot order is named
        (:meth:`off_plan`)."""
        came_back, where = tell.ask(lambda core: (self.returns(work), self.off_plan(work)))
        if came_back:
            tell.peers(work, "forward")
        return where

    def visit_missed(self, tell: Tell, work: Work) -> str | None:
        return tell.ask(lambda core: self.missed_visit(work))

    # --- visits (a microbatch that comes back to the rank) ------------------------------------

    def visit_over(self, work: Work, reply: bool = False) -> bool:
        """``work`` waits for another rank: a leader's forward has then left partition 0, and
        its visit is over, unless the plan has a later visit and the task has not computed in
        this one yet (the root's code fetching an output before the head's modules run); so
        is a leader's backward's visit where the plan has an earlier one to come back to, once
        the visit sends no more backward requests (the backward of a head on partition 0,
        whose gradients the partitions before it wait for). Whether that ended an action (the
        token may then go on).

        A forward waiting for the ``reply`` of a call only to learn its outputs' structure (a
        module's first call: later ones are deferred) has not left for good where the plan has
        a later visit: it would have gone on without waiting, perhaps calling that partition
        again (a module's layers there, one by one). Its visit ends when it next computes here
        (:meth:`back_from_replies`) or waits for a value. (The first call of a module is microbatch
        0's, whose forward comes first in every rank's plan row, so the turn it keeps holds up
        nobody; replies awaited in every microbatch, for hooks replayed, end the visit.)"""
        if work.role != "leader":
            return False
        if work.phase == "F":
            if reply and self._has(work, "F", work.visit + 1):
                work.away = work.away or work.computed
                return False
            work.away = False
            if not work.computed and self._has(work, "F", work.visit + 1):
                return False
            work.computed = False
            return self.end(work.step, "F", work.microbatch, work.visit)
        if (
            is_gradient(work.phase)
            and self._has(work, "B", work.visit - 1)
            and not any(work.remote_nodes.values())
        ):
            return self.end(work.step, "B", work.microbatch, work.visit)
        return False

    def back_from_replies(self, work: Work) -> bool:
        """``work`` is about to compute here: if it waited for replies since it computed last
        (:meth:`visit_over`), its visit is over now, as it would have been at the wait.
        Whether that ended an action."""
        if not work.away:
            return False
        work.away = False
        return self.visit_over(work)

    def returns(self, work: Work) -> bool:
        """``work`` computes here again after it waited: where its visit is over and the plan
        has the next one (forward) or the earlier one (backward), it is that visit's work now.
        Whether a forward came back: a plan's route comes back to the leader only at its end,
        so no other rank computes that forward any more."""
        if work.role != "leader" or not self.ended(
            work.step, work.phase, work.microbatch, work.visit
        ):
            return False
        forward = not is_gradient(work.phase)
        visit = work.visit + (1 if forward else -1)
        if not self._has(work, work.phase, visit):
            return False
        work.visit = visit
        return forward

    def _has(self, work: Work, phase: str, visit: int) -> bool:
        """Whether the plan has ``phase`` of ``work``'s microbatch at ``visit``."""
        return visit >= 0 and self.order(work.step).has(phase, work.microbatch, visit)

    def off_plan(self, work: Work) -> str | None:
        """Where ``work`` would compute that the plan cannot order (None: nowhere). The plan
        runs each microbatch through the partitions in order, once forward and once back: work
        that comes back to partition 0, or to an action already over, has no place in it."""
        if work.role == "main":
            return None
        mb = work.microbatch
        over = self.ended(work.step, work.phase, mb, work.visit)
        if work.role == "leader" and work.phase == "F" and over:
            return f"on partition 0 after microbatch {mb} waited for another partition"
        if work.role == "serve" and self.rank == 0:
            return "on partition 0, called from another partition"
        if work.role == "serve" and over:
            what = {"F": "forward", "W": "weight half"}.get(work.phase, "backward")
            return f"on partition {self.rank} after microbatch {mb}'s {what} here was over"
        return None

    def missed_visit(self, work: Work) -> str | None:
        """Why a leader's forward ``work`` may not turn to its backward (None: it may): the
        plan has it come back to partition 0 for a later visit it never made (the model's
        modules run in another order than they are registered in)."""
        if work.role != "leader" or not self._has(work, "F", work.visit + 1):
            return None
        return (
            f"microbatch {work.microbatch}'s forward ended at visit {work.visit} of partition "
            f"0, but the plan has it come back for visit {work.visit + 1}"
        )


def ordering_for(rows: PlanRows, rank: int, planned: bool) -> Ordering:
    """Rank ``rank``'s ordering, chosen once: its row of ``rows`` where the ranks follow their
    plan (``planned``), else the free one."""
    return PlannedOrdering(rows.plan_row(rank), rank) if planned else FreeOrdering()

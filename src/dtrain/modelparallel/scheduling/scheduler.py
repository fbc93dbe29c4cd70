"""One rank's scheduling decisions, without threads: who computes next, and when work may begin.

A pipeline stage is one worker, so a rank computes one piece of work at a time; who that is
follows from a few rules, all here, on plain data:

* the compute token goes to the waiting work the policy ranks first (:meth:`Scheduler.grant`),
  but not past work announced before it at least as urgent (:meth:`Scheduler.announce`), nor,
  while the main task waits and weight halves are owed, to anything but those, nor, with a plan
  order (``deterministic_server``), to work whose action is not the rank's current one;
* a holder between two computations keeps the token (*sticky*) unless more urgent work waits
  (:meth:`Scheduler.outranked`, :meth:`Scheduler.steps_aside`);
* the leader admits a microbatch while fewer than ``active`` are in flight (admitted, task not
  finished: :attr:`Scheduler.in_flight`), and in ``simple`` holds every backward until every
  forward is done (:meth:`Scheduler.backward_may_start`);
* a leader's backward that no other rank waits for is *terminal* (:attr:`Work.terminal`) and
  yields to forwards.

The runtime's :class:`~..pipeline.executor.Executor` drives one scheduler per rank with its threads
and lock (it wakes the work :meth:`Scheduler.grant` returns); the planner
(:func:`~.planner.schedule_of`) drives one per stage over a model of the pipeline's times.
The plan is therefore the order these rules give, and the rules are tested as tables, without
threads or processes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from dtrain.modelparallel.scheduling.order import Key as ActionKey
from dtrain.modelparallel.scheduling.order import PlanOrder, PlanRow, action_key
from dtrain.modelparallel.scheduling.policy import MAIN_PRIORITY, SchedulePolicy
from dtrain.modelparallel.scheduling.rules import Phase, is_gradient

Role = Literal["main", "leader", "serve"]
Key = tuple[int, int]
"""A rank in line for the token: the lowest goes first."""


@dataclass(eq=False)
class Work:
    """What a rank schedules: the script's main thread, a microbatch's step body on the leader,
    or a stream of requests served (and a split backward's weight half)."""

    role: Role
    microbatch: int = 0
    phase: Phase = "F"
    name: str = ""
    step: int = 0
    """The leader's step this work belongs to."""
    visit: int = 0
    """Which of this rank's stages on the microbatch's way the work is (0 unless the
    microbatch comes back to the rank, see :mod:`.order`)."""
    computed: bool = False
    """The work has computed here since its visit began (:meth:`Scheduler.computes`)."""
    away: bool = False
    """A leader's forward waited for a call's reply only to learn its structure since it last
    computed: its visit ends when it computes here again (:meth:`Scheduler.waits`)."""
    remote_nodes: Counter[int] = field(default_factory=Counter, repr=False)
    """Per owner (pp rank), the outputs this work fetched onto its autograd graph whose
    backward has not run yet: each will send the owner a backward request."""

    @property
    def terminal(self) -> bool:
        """A leader's backward that no other rank waits for any more (the first stage's of a
        chain, or what is left after its last remote backward): it feeds nobody, so it yields
        to forwards, which feed the other stages."""
        return self.role == "leader" and self.phase == "B" and not any(self.remote_nodes.values())

    def sends_backward_to(self, owner: int) -> bool:
        """Whether this work's backward will still send ``owner`` a request (the one rule
        behind :attr:`terminal` and an owner's last backward of a microbatch)."""
        return self.remote_nodes[owner] > 0

    def describe(self) -> str:
        if self.role == "main":
            return "the main thread (outside the step)"
        what = "microbatch task" if self.role == "leader" else f"served {self.name!r}"
        return f"{what} {self.phase}{self.microbatch}"


@dataclass
class Waiter:
    """Work in line for the token: its rank, then its place in line."""

    key: Key
    seq: int
    work: Work


class Scheduler:
    """The compute token of one rank and the leader's admission, as decisions on plain data.

    Whoever drives it calls :meth:`submit` when work asks for the token, :meth:`grant` to hand
    a free token on (it returns the new holder, to be woken), :meth:`release` when the holder
    gives it back, and :meth:`admit` / :meth:`finished` as the leader's microbatches start and end.
    """

    def __init__(
        self,
        policy: SchedulePolicy,
        plan: PlanRow | None = None,
        main: Work | None = None,
        rank: int = 0,
    ) -> None:
        """``plan`` (this rank's compute actions, in order) makes the token follow it; ``main``
        (the script's thread) outranks all work and, while it waits, lets only owed weight
        halves go first; ``rank`` is the pp rank (partition) this core schedules."""
        self.policy = policy
        self.rank = rank
        self.plan = plan
        self.main = main
        self.holder: Work | None = None
        self.sticky = False
        """The holder holds the token between two computations."""
        self._waiting: list[Waiter] = []
        self._announced: dict[Work, Waiter] = {}
        """Work dispatched that has not asked for the token yet: its key and place in line."""
        self._seq: Iterator[int] = itertools.count()
        self._orders: dict[int, PlanOrder] = {}
        self.weights_owed: list[tuple[int, int]] = []
        """(step, microbatch) of each weight half deferred and not run yet."""
        self.leading = False
        """The leader's step is under way (:meth:`begin_step`)."""
        self.admitted = 0
        self.finished_count = 0
        self.forwards_done: set[int] = set()

    # --- the token -----------------------------------------------------------------------------

    def key(self, work: Work) -> Key:
        if work.role == "main":
            return MAIN_PRIORITY
        return self.policy.priority(work.phase, work.microbatch, work.terminal)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def announce(self, work: Work) -> None:
        """``work`` will ask for the token: no work announced or submitted after it takes the
        token before it, unless more urgent (requests are dispatched in arrival order, but the
        threads that serve them start in any order)."""
        self._announced[work] = Waiter(self.key(work), next(self._seq), work)

    def withdraw(self, work: Work) -> bool:
        """Announced ``work`` ended without asking for the token: it stops holding others up.
        Whether it was announced (the token may then go on)."""
        return self._announced.pop(work, None) is not None

    def submit(self, work: Work) -> None:
        """``work`` asks for the token, keeping its place in line if it was announced."""
        announced = self._announced.pop(work, None)
        seq = next(self._seq) if announced is None else announced.seq
        self._waiting.append(Waiter(self.key(work), seq, work))

    def is_waiting(self, work: Work) -> bool:
        return any(entry.work is work for entry in self._waiting)

    def drop(self, work: Work) -> None:
        """``work`` stops waiting (it timed out)."""
        self._waiting = [entry for entry in self._waiting if entry.work is not work]

    def eligible(self) -> list[Waiter]:
        """The waiters the token may go to: not one submitted after announced work at least as
        urgent (with a plan order, announced work in its turn); while the main task waits and
        weight halves are owed, only those; with a plan order, only the current action's."""
        waiting = self._waiting
        if self.weights_owed and any(entry.work is self.main for entry in waiting):
            waiting = [entry for entry in waiting if entry.work.phase == "W"]
        if not self._announced and self.plan is None:
            return list(waiting)
        # Out of turn, announced work would hold up the turn it waits for (a backward request
        # dispatched before the forward it follows: a deadlock).
        ahead = [a for a in self._announced.values() if self.in_turn(a.work)]
        return [
            entry
            for entry in waiting
            if self.in_turn(entry.work)
            and not any(a.key <= entry.key and a.seq < entry.seq for a in ahead)
        ]

    def grant(self) -> Work | None:
        """Hand a free token to the most urgent eligible waiter; the new holder (to be woken),
        or None."""
        if self.holder is not None or not self._waiting:
            return None
        eligible = self.eligible()
        if not eligible:
            return None
        entry = min(eligible, key=lambda e: (e.key, e.seq))
        self._waiting.remove(entry)
        self.holder = entry.work
        self.sticky = False
        return entry.work

    def release(self, work: Work) -> None:
        if self.holder is not work:
            raise RuntimeError(f"{work.describe()} releases a compute token it does not hold")
        self.holder = None
        self.sticky = False

    def between(self, work: Work) -> None:
        """The holder ``work`` finished a computation and keeps the token for its next one."""
        if self.holder is work:
            self.sticky = True

    def resume(self, work: Work) -> None:
        """The holder ``work`` computes again."""
        if self.holder is work:
            self.sticky = False

    def outranked(self, work: Work) -> bool:
        """Whether the holder ``work`` should give the token up before computing again: more
        urgent work may take it, or a plan order has moved on from ``work``'s action."""
        key = self.key(work)
        return not self.in_turn(work) or any(entry.key < key for entry in self.eligible())

    def steps_aside(self, work: Work) -> bool:
        """Whether the holder ``work``, between computations and about to do other work (send a
        reply), should let any eligible waiter compute meanwhile; with a plan order, also once
        its action has ended: the next action's work may then become eligible (the holder's
        own action passes only once it gives the token up)."""
        if self.holder is not work or not self.sticky:
            return False
        return bool(self.eligible()) or self._own_action_ended(work)

    def _own_action_ended(self, work: Work) -> bool:
        if self.plan is None or work.role == "main":
            return False
        key = action_key(work.phase, work.microbatch, work.visit)
        return key in self.order(work.step).ended

    # --- the plan's order (deterministic_server) ------------------------------------------------

    def in_turn(self, work: Work) -> bool:
        """Whether the plan order (if any) lets ``work`` compute now."""
        if self.plan is None or work.role == "main":
            return True
        return self.order(work.step).admits(work.phase, work.microbatch, work.visit)

    def order(self, step: int) -> PlanOrder:
        """The plan's order for ``step``, moved on past every ended action no work here still
        belongs to; the orders of steps two or more before are dropped."""
        assert self.plan is not None
        order = self._orders.get(step)
        if order is None:
            order = self._orders[step] = PlanOrder.of(self.plan)
            for old in [s for s in self._orders if s < step - 1]:
                del self._orders[old]
        order.advance(lambda key: self._busy(step, key))
        return order

    def turn(self) -> str | None:
        """The plan order's current action in the latest step begun here (None: no plan)."""
        if self.plan is None or not self._orders:
            return None
        step = max(self._orders)
        return f"{self.order(step).describe()} of step {step}"

    def _busy(self, step: int, key: ActionKey) -> bool:
        """Whether work of action ``key`` in ``step`` is announced, waiting or computing here."""
        works = [*(e.work for e in self._waiting), *self._announced, self.holder]
        return any(
            w is not None
            and w.role != "main"
            and w.step == step
            and action_key(w.phase, w.microbatch, w.visit) == key
            for w in works
        )

    def end_action(self, step: int, phase: str, microbatch: int, visit: int | None = None) -> bool:
        """This rank's action ``phase`` of ``microbatch`` in ``step`` (at ``visit``, or every
        visit) is over once no work of it is left here; whether there is a plan order (the
        token may then go on)."""
        if self.plan is None:
            return False
        self.order(step).end(phase, microbatch, visit)
        return True

    def action_ended(self, step: int, phase: str, microbatch: int, visit: int = 0) -> bool:
        return self.plan is not None and self.order(step).has_ended(phase, microbatch, visit)

    def computes(self, work: Work) -> None:
        """``work`` computes (holding the token): its visit has begun here."""
        work.computed = True

    def waits(self, work: Work, reply: bool = False) -> bool:
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
        (:meth:`comes_back`) or waits for a value. (The first call of a module is microbatch
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
            return self.end_action(work.step, "F", work.microbatch, work.visit)
        if (
            is_gradient(work.phase)
            and self._has(work, "B", work.visit - 1)
            and not any(work.remote_nodes.values())
        ):
            return self.end_action(work.step, "B", work.microbatch, work.visit)
        return False

    def comes_back(self, work: Work) -> bool:
        """``work`` is about to compute here: if it waited for replies since it computed last
        (:meth:`waits`), its visit is over now, as it would have been at the wait. Whether
        that ended an action."""
        if not work.away:
            return False
        work.away = False
        return self.waits(work)

    def returns(self, work: Work) -> bool:
        """``work`` computes here again after it waited: where its visit is over and the plan
        has the next one (forward) or the earlier one (backward), it is that visit's work now.
        Whether a forward came back: a plan's route comes back to the leader only at its end,
        so no other rank computes that forward any more."""
        if work.role != "leader" or not self.action_ended(
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
        """Whether the plan order has ``phase`` of ``work``'s microbatch at ``visit``."""
        return (
            self.plan is not None
            and visit >= 0
            and self.order(work.step).has(phase, work.microbatch, visit)
        )

    def off_plan(self, work: Work) -> str | None:
        """Where ``work`` would compute that a plan order cannot order (None: nowhere). The
        plan runs each microbatch through the partitions in order, once forward and once back:
        work that comes back to partition 0, or to an action already over, has no place in it."""
        if self.plan is None or work.role == "main":
            return None
        mb = work.microbatch
        over = self.action_ended(work.step, work.phase, mb, work.visit)
        if work.role == "leader" and work.phase == "F" and over:
            return f"on partition 0 after microbatch {mb} waited for another partition"
        if work.role == "serve" and self.rank == 0:
            return "on partition 0, called from another partition"
        if work.role == "serve" and over:
            what = {"F": "forward", "W": "weight half"}.get(work.phase, "backward")
            return f"on partition {self.rank} after microbatch {mb}'s {what} here was over"
        return None

    def visit_missed(self, work: Work) -> str | None:
        """Why a leader's forward ``work`` may not turn to its backward (None: it may): the
        plan has it come back to partition 0 for a later visit it never made (the model's
        modules run in another order than they are registered in)."""
        if work.role != "leader" or not self._has(work, "F", work.visit + 1):
            return None
        return (
            f"microbatch {work.microbatch}'s forward ended at visit {work.visit} of partition "
            f"0, but the plan has it come back for visit {work.visit + 1}"
        )

    # --- weight halves -------------------------------------------------------------------------

    def owe(self, step: int, microbatch: int) -> None:
        """A split backward's weight half is due: the main task waits for it. Owed before the
        backward replies, so that no end of the microbatch can be taken for the end of its
        weights."""
        self.weights_owed.append((step, microbatch))

    def paid(self, step: int, microbatch: int) -> None:
        """The owed weight half has run (or failed): the main task may be next. The weight
        action is over once the microbatch's last backward here has run and no half of it is
        owed: a rank whose modules the caller calls one by one has a backward, and perhaps a
        weight half, for each."""
        self.weights_owed.remove((step, microbatch))
        if not self.owes(step, microbatch) and self.action_ended(step, "B", microbatch):
            self.end_action(step, "W", microbatch)

    def end_backward(self, step: int, microbatch: int) -> bool:
        """The microbatch's last backward here has run: its backward action is over, and its
        weight action too unless a half of it is still owed (another module's, split earlier).
        Whether there is a plan order (the token may then go on)."""
        if self.plan is None:
            return False
        self.end_action(step, "B", microbatch)
        if not self.owes(step, microbatch):
            self.end_action(step, "W", microbatch)
        return True

    def owes(self, step: int, microbatch: int) -> bool:
        return (step, microbatch) in self.weights_owed

    def end_microbatch(self, step: int, microbatch: int) -> bool:
        """The leader's task of ``microbatch`` is over: so are this rank's forward and backward
        of it, and its weight half unless one is still owed (it was owed before the backward
        replied, so the end that reply leads to is not taken for the end of the weights).
        Whether there is a plan order (the token may then go on)."""
        self.end_action(step, "F", microbatch)
        return self.end_backward(step, microbatch)

    # --- the leader's step ---------------------------------------------------------------------

    def begin_step(self) -> None:
        self.leading = True
        self.admitted = self.finished_count = 0
        self.forwards_done = set()

    def end_step(self) -> None:
        self.leading = False

    @property
    def in_flight(self) -> int:
        """Microbatches admitted whose task has not finished: the one count the bound is on."""
        return self.admitted - self.finished_count

    def may_admit(self) -> bool:
        return self.policy.may_admit(self.in_flight)

    def admit(self) -> int:
        """Start the next microbatch; its number."""
        self.admitted += 1
        return self.admitted - 1

    def forward_done(self, microbatch: int) -> None:
        self.forwards_done.add(microbatch)

    def backward_may_start(self) -> bool:
        """``simple`` holds every backward until every microbatch's forward is done."""
        return self.policy.backward_may_start(len(self.forwards_done))

    def finished(self, work: Work) -> None:
        """The leader's task ``work`` is over: its microbatch leaves the flight, and its forward
        (done too, if it failed before its backward) and backward actions here end."""
        self.forwards_done.add(work.microbatch)
        self.finished_count += 1
        for phase in ("F", "B"):
            self.end_action(work.step, phase, work.microbatch)

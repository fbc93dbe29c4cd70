"""One rank's scheduling decisions, without threads: who computes next, and when work may begin.

A pipeline stage is one worker, so a rank computes one piece of work at a time; who that is
follows from a few rules, all here, on plain data:

* the compute token goes to the waiting work the policy ranks first (:meth:`Scheduler.grant`),
  but not past work announced before it at least as urgent (:meth:`Scheduler.announce`), nor,
  while the main task waits and weight halves are owed, to anything but those, nor to work its
  :class:`Turns` says is out of turn (a planned ordering's: work whose action is not the rank's
  current one in its plan row);
* a holder between two computations keeps the token (*sticky*) unless more urgent work waits
  (:meth:`Scheduler.outranked`, :meth:`Scheduler.steps_aside`);
* the leader admits a microbatch while fewer than ``active`` are in flight (admitted, task not
  finished: :attr:`Scheduler.in_flight`), and in ``simple`` holds every backward until every
  forward is done (:meth:`Scheduler.backward_may_start`);
* a leader's backward that no other rank waits for is *terminal* (:attr:`Work.terminal`) and
  yields to forwards.

Whose turn it is, beyond these rules, is the rank's ordering's (:mod:`.ordering`), a strategy
chosen once: the free ordering (every work in turn) or a planned one (the plan row's order).

The runtime's :class:`~..pipeline.executor.Executor` drives one scheduler per rank with its threads
and lock (it wakes the work :meth:`Scheduler.grant` returns); the runtime model
(:mod:`.runtime_model`), which the planner runs and the tests drive, drives one per rank over
simulated time. The plan is therefore the order these rules give, and the rules are tested as
tables, without threads or processes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from dtrain.modelparallel.scheduling.order import Key as ActionKey
from dtrain.modelparallel.scheduling.order import action_key
from dtrain.modelparallel.scheduling.policy import MAIN_PRIORITY, SchedulePolicy
from dtrain.modelparallel.scheduling.rules import Phase

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
    computed: its visit ends when it computes here again (see :mod:`.ordering`)."""
    called: int | None = None
    """The partition a leader's forward called last (see :mod:`.ordering`)."""
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


Busy = Callable[[int, ActionKey], bool]
"""Whether work of an action (in a step) is announced, waiting or computing on the rank."""


class Turns(Protocol):
    """What the core asks its ordering (:mod:`.ordering`), always under the core's lock."""

    def watch(self, busy: Busy) -> None:
        """The core says where to look for the work of an action still on the rank."""

    def in_turn(self, work: Work) -> bool:
        """Whether ``work`` may compute now (the main task always may)."""

    def end(self, step: int, phase: str, microbatch: int, visit: int | None = None) -> bool:
        """The rank's action ``phase`` of ``microbatch`` in ``step`` (at ``visit``, or every
        visit) is over once no work of it is left here; whether the token may then go on."""

    def ended(self, step: int, phase: str, microbatch: int, visit: int = 0) -> bool:
        """Whether the action's turn has passed."""

    def own_action_ended(self, work: Work) -> bool:
        """Whether ``work``'s action has been said over (the next one's work may then be
        eligible once ``work`` gives the token up)."""

    def describe_turn(self) -> str:
        """Whose turn it is, for stall reports (empty where every work is in turn)."""


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

    def __init__(self, policy: SchedulePolicy, ordering: Turns, main: Work | None = None) -> None:
        """``ordering`` says whose turn it is (:mod:`.ordering`); ``main`` (the script's thread)
        outranks all work and, while it waits, lets only owed weight halves go first."""
        self.policy = policy
        self.ordering = ordering
        self.main = main
        self.holder: Work | None = None
        self.sticky = False
        """The holder holds the token between two computations."""
        self._waiting: list[Waiter] = []
        self._announced: dict[Work, Waiter] = {}
        """Work dispatched that has not asked for the token yet: its key and place in line."""
        self._seq: Iterator[int] = itertools.count()
        self.weights_owed: list[tuple[int, int]] = []
        """(step, microbatch) of each weight half deferred and not run yet."""
        self.leading = False
        """The leader's step is under way (:meth:`begin_step`)."""
        self.admitted = 0
        self.finished_count = 0
        self.forwards_done: set[int] = set()
        ordering.watch(self._busy)

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
        """The waiters the token may go to: those in turn, not one submitted after announced
        work (in turn) at least as urgent; while the main task waits and weight halves are
        owed, only those."""
        waiting = self._waiting
        if self.weights_owed and any(entry.work is self.main for entry in waiting):
            waiting = [entry for entry in waiting if entry.work.phase == "W"]
        in_turn = self.ordering.in_turn
        if not self._announced:
            return [entry for entry in waiting if in_turn(entry.work)]
        # Out of turn, announced work would hold up the turn it waits for (a backward request
        # dispatched before the forward it follows: a deadlock).
        ahead = [a for a in self._announced.values() if in_turn(a.work)]
        return [
            entry
            for entry in waiting
            if in_turn(entry.work)
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
        urgent work may take it, or its turn has passed."""
        if not self.in_turn(work):
            return True
        if not self._waiting:  # the usual answer, asked at every layer of a backward
            return False
        key = self.key(work)
        return any(entry.key < key for entry in self.eligible())

    def steps_aside(self, work: Work) -> bool:
        """Whether the holder ``work``, between computations and about to do other work (send a
        reply), should let any eligible waiter compute meanwhile; also once its action has been
        said over: the next action's work may then become eligible (the holder's own action
        passes only once it gives the token up)."""
        if self.holder is not work or not self.sticky:
            return False
        return bool(self.eligible()) or self.ordering.own_action_ended(work)

    def in_turn(self, work: Work) -> bool:
        """Whether the ordering lets ``work`` compute now (the main task always may)."""
        return self.ordering.in_turn(work)

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

    def computes(self, work: Work) -> None:
        """``work`` computes (holding the token): its visit has begun here."""
        work.computed = True

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
        if not self.owes(step, microbatch) and self.ordering.ended(step, "B", microbatch):
            self.ordering.end(step, "W", microbatch)

    def end_backward(self, step: int, microbatch: int) -> bool:
        """The microbatch's last backward here has run: its backward action is over, and its
        weight action too unless a half of it is still owed (another module's, split earlier).
        Whether the token may then go on."""
        moved = self.ordering.end(step, "B", microbatch)
        if not self.owes(step, microbatch):
            self.ordering.end(step, "W", microbatch)
        return moved

    def owes(self, step: int, microbatch: int) -> bool:
        return (step, microbatch) in self.weights_owed

    def end_microbatch(self, step: int, microbatch: int) -> bool:
        """The leader's task of ``microbatch`` is over: so are this rank's forward and backward
        of it, and its weight half unless one is still owed (it was owed before the backward
        replied, so the end that reply leads to is not taken for the end of the weights).
        Whether the token may then go on."""
        self.ordering.end(step, "F", microbatch)
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

    def forward_over(self, work: Work) -> bool:
        """The leader's task ``work`` turns to its backward: its forward is done (``simple``'s
        hold counts it) and its forward action here is over. Whether the token may go on."""
        self.forward_done(work.microbatch)
        return self.ordering.end(work.step, "F", work.microbatch)

    def backward_may_start(self) -> bool:
        """``simple`` holds every backward until every microbatch's forward is done."""
        return self.policy.backward_may_start(len(self.forwards_done))

    def finished(self, work: Work) -> None:
        """The leader's task ``work`` is over: its microbatch leaves the flight, and its forward
        (done too, if it failed before its backward) and backward actions here end."""
        self.forwards_done.add(work.microbatch)
        self.finished_count += 1
        for phase in ("F", "B"):
            self.ordering.end(work.step, phase, work.microbatch)

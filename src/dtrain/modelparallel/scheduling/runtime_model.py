"""The pipeline's runtime as discrete events: every rank's scheduling core driven as the runtime
drives it, over simulated time; no threads, no processes. The planner runs it (a plan is the
order it gives: :mod:`.planner`), and the tests drive it (with plan rows, every rank follows
its row).

One :class:`~.scheduler.Scheduler` per rank, with its ordering (:mod:`.ordering`), gets the
calls the executor makes, in the order it makes them: the leader admits microbatches and queues
each task for the token at once; its task computes its forward, waits (the token is given up),
turns to its backward once its forward has reached the last stage (the forward is done
everywhere), and queues for the token again when the gradients come back. Requests arrive in
streams, each served by one task that is announced on arrival, asks for the token as its
thread starts (a backward only once its forward has run here), keeps the token between its
jobs unless outranked, and gives it back at its end; a split backward owes its weight half
before it replies, and the weight half is a task of its own, paid when it has run. What an
event ends, and who learns it, is the ordering's to say (:class:`~.ordering.Tell`): a notice
to another rank arrives a message later. Every computation takes the plan's cost, every
message ``costs.comm``.

Stage ``s`` runs on rank ``route[s]`` (a chain ``0, 1, ...`` unless a route comes back to the
leader: a head tied to the embedding, see :mod:`.route`); activations go from a stage to the
next, gradients back. (The runtime relays activations between partitions other than the
leader's through the leader; the model folds the two hops into one message.) The last
stage's backward request travels with its forward; with ``fetched_loss`` the leader computes
the loss from the last stage's outputs instead, which it fetches.

Which work a rank computes next is decided once everything that reaches it at an instant has:
among simultaneous arrivals the core's rules choose, where the runtime's order depends on which
thread gets there first.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.ordering import FreeOrdering, Notice, Ordering
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.rules import Phase, backward_phases
from dtrain.modelparallel.scheduling.schedule import ScheduleError
from dtrain.modelparallel.scheduling.scheduler import Scheduler, Work

T = TypeVar("T")

STEP = 1
"""The step every work belongs to (the runtime's first)."""

Visit = tuple[str, int, int]
"""A compute action of a rank: ``(kind, microbatch, visit)`` (see :mod:`.order`)."""


class RuntimeDeadlock(ScheduleError):
    """Work is left and nothing can happen any more; the message holds each rank's turn."""


@dataclass(eq=False)
class Stream:
    """Work of one microbatch that one message brought a rank (or the leader's task at one of
    its stages), served by one task: its jobs' phases, in order."""

    work: Work
    phases: list[Phase]
    stage: int
    job: int = 0


@dataclass(eq=False)
class _Rank:
    core: Scheduler
    ordering: Ordering
    tell: _Tell
    streams: dict[Work, Stream] = field(default_factory=dict)
    parked: list[Stream] = field(default_factory=list)
    """Announced backward streams whose forward has not run here yet."""
    between: Stream | None = None
    """The holder between two of its jobs: whether it goes on is decided at the instant's end."""
    order: list[Visit] = field(default_factory=list)
    forwards_run: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Tell:
    """An ordering's notices in the model: on the rank at once, to another a message later."""

    model: RuntimeModel
    rank: int

    def here(self, change: Callable[[Scheduler], bool]) -> None:
        change(self.model.ranks[self.rank].core)  # the token goes on at the instant's end

    def ask(self, question: Callable[[Scheduler], T]) -> T:
        return question(self.model.ranks[self.rank].core)

    def peers(self, work: Work, notice: Notice) -> None:
        for rank in range(len(self.model.ranks)):
            if rank != self.rank:
                self.model.notify(rank, work, notice)

    def after_queued(self, work: Work, partition: int, notice: Notice) -> None:
        self.model.notify(partition, work, notice)


class RuntimeModel:
    """One step; :meth:`run` returns each rank's computations ``(phase, microbatch, visit)``
    in the order they started, :attr:`makespan` when the last one ended."""

    def __init__(
        self,
        policy: SchedulePolicy,
        costs: Costs,
        route: tuple[int, ...] = (),
        orderings: Sequence[Ordering] = (),
        fetched_loss: bool = False,
    ) -> None:
        """``costs`` per stage; ``route``: stage ``s`` on rank ``route[s]`` (default: a
        chain); ``orderings``: each rank's (default: the free one). ``fetched_loss``: the
        leader computes the loss from the last stage's outputs, which it fetches (a chain of
        two stages or more); its backward then takes its turn on the first stage before it
        sends the backward request (the loss's backward is its own)."""
        stages = len(costs.forward)
        self.policy, self.costs = policy, costs
        self.route = route or tuple(range(stages))
        if len(self.route) != stages:
            raise ValueError(f"route: got {self.route}; need one partition per stage ({stages})")
        self.last = stages - 1
        self.fetched_loss = fetched_loss and stages > 1
        if self.fetched_loss and self.route[self.last] == 0:
            raise ValueError("fetched_loss: the last stage is the leader's already")
        self.visit_of = [self.route[:s].count(rank) for s, rank in enumerate(self.route)]
        count = max(self.route) + 1
        orderings = orderings or [FreeOrdering() for _ in range(count)]
        self.ranks = [
            _Rank(Scheduler(policy, ordering), ordering, _Tell(self, rank))
            for rank, ordering in enumerate(orderings)
        ]
        self.leader = self.ranks[0].core
        self.tasks: dict[int, Work] = {}
        """The leader's microbatch tasks."""
        self.held: list[int] = []
        """Microbatches whose backward waits for ``simple``'s hold."""
        self.requesting: set[int] = set()
        """Leader tasks whose next computation is their loss's backward, then the request."""
        self.now = 0.0
        self.makespan = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    # --- time ----------------------------------------------------------------------------------

    def _at(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (self.now + delay, next(self._seq), action))

    def run(self) -> list[list[Visit]]:
        self.leader.begin_step()
        self._admit()
        self._decide()
        while self._events:
            self.now = self._events[0][0]
            while self._events and self._events[0][0] <= self.now:
                heapq.heappop(self._events)[2]()
            self._decide()
        if self.leader.finished_count < self.policy.microbatches or any(
            r.core.waiting or r.core.weights_owed for r in self.ranks
        ):
            turns = {rank: r.ordering.describe_turn() for rank, r in enumerate(self.ranks)}
            shown = f"; each rank's turn: {turns}" if any(turns.values()) else ""
            raise RuntimeDeadlock(
                f"the {self.policy.pipeline} pipeline stops, no rank can go on{shown}"
            )
        return [r.order for r in self.ranks]

    def notify(self, rank: int, work: Work, notice: Notice) -> None:
        """``notice`` of ``work``'s microbatch reaches ``rank`` a message later."""
        target = self.ranks[rank]
        step, microbatch = work.step, work.microbatch
        self._at(
            self.costs.comm,
            lambda: target.ordering.heard(target.tell, notice, step, microbatch),
        )

    # --- the token -----------------------------------------------------------------------------

    def _decide(self) -> None:
        """Everything that reaches a rank at this instant has: each free rank's token goes to
        the work its core ranks first (a holder between two jobs goes on unless outranked)."""
        for r, rank in enumerate(self.ranks):
            stream, rank.between = rank.between, None
            if stream is not None:
                self._place(r, stream)
                if not rank.core.outranked(stream.work):
                    rank.core.resume(stream.work)
                    self._compute(r, stream)
                    continue
                rank.core.release(stream.work)
                rank.core.submit(stream.work)
            work = rank.core.grant()
            if work is not None:
                self._compute(r, rank.streams[work])

    def _place(self, r: int, stream: Stream) -> None:
        """Before ``stream``'s work asks for the token to compute: the ordering places it."""
        rank, work = self.ranks[r], stream.work
        where = rank.ordering.placing(rank.tell, work)
        if where is not None:
            raise ScheduleError(f"{work.describe()} would compute {where}")
        work.visit = self.visit_of[stream.stage]
        rank.streams[work] = stream

    def _ask(self, r: int, stream: Stream) -> None:
        """The stream's task asks for the token (its thread started, or it waited)."""
        self._place(r, stream)
        self.ranks[r].core.submit(stream.work)

    def _compute(self, r: int, stream: Stream) -> None:
        rank, work = self.ranks[r], stream.work
        rank.core.computes(work)
        action = (work.phase, work.microbatch, work.visit)
        if rank.order[-1:] != [action]:  # one action's periods once
            rank.order.append(action)
        cost = self.costs.of(work.phase, stream.stage)
        if work.role == "leader" and work.microbatch in self.requesting:
            cost = 0.0  # the loss's own backward: the request goes out at once
        self.makespan = max(self.makespan, self.now + cost)
        self._at(cost, lambda: self._computed(r, stream))

    def _computed(self, r: int, stream: Stream) -> None:
        rank, work = self.ranks[r], stream.work
        rank.core.between(work)
        phase = work.phase
        stream.job += 1
        if work.role == "leader":
            self._leader_computed(stream)
            return
        self._served(r, stream, phase)
        if stream.job < len(stream.phases):  # its next job: kept unless outranked
            work.phase = stream.phases[stream.job]
            rank.between = stream
            return
        rank.core.release(work)
        if phase == "W":
            rank.core.paid(STEP, work.microbatch)

    # --- the leader ----------------------------------------------------------------------------

    def _admit(self) -> None:
        leader = self.leader
        while leader.admitted < self.policy.microbatches and leader.may_admit():
            mb = leader.admit()
            work = Work("leader", mb, "F", step=STEP)
            self.tasks[mb] = work
            self._ask(0, Stream(work, ["F"], 0))

    def _leader_computed(self, stream: Stream) -> None:
        task, stage = stream.work, stream.stage
        mb, leader = task.microbatch, self.ranks[0]
        if task.phase == "F" and stage == self.last:  # its backward follows here
            due = self._forward_over(mb)
            if mb in due:  # kept unless outranked or held
                leader.between = Stream(task, ["B"], stage)
            else:
                leader.core.release(task)
            for other in due:
                if other != mb:
                    self._ask(0, Stream(self.tasks[other], ["B"], self.last))
            return
        if task.phase == "F":  # it waits for the next stage
            self._waits(task)
            leader.core.release(task)
            self._send_forward(stage, mb)
            return
        if mb in self.requesting:  # the loss's backward: the request goes to the last stage
            self.requesting.discard(mb)
            task.remote_nodes.clear()
            self._waits(task)
            leader.core.release(task)
            self._at(self.costs.comm, lambda: self._backward(self.last, mb))
            return
        if stage > 0:  # the backward of the leader's later stage: the gradients go back
            task.remote_nodes[self.route[stage - 1]] -= 1
            self._waits(task)
            leader.core.release(task)
            self._at(self.costs.comm, lambda: self._gradients_arrived(stage - 1, mb))
            return
        # The task ends: the next microbatch is admitted before the token goes on.
        leader.core.release(task)
        leader.core.finished(task)
        leader.ordering.microbatch_over(leader.tell, task)
        self._admit()

    def _waits(self, task: Work) -> None:
        """The leader's task waits for another rank."""
        leader = self.ranks[0]
        leader.ordering.waits(leader.tell, task, False)

    def _forward_over(self, mb: int) -> list[int]:
        """The leader's task turns to its backward: the forward is over on every rank. The
        microbatches whose backward ``simple``'s hold lets begin now."""
        leader, task = self.ranks[0], self.tasks[mb]
        missed = leader.ordering.visit_missed(leader.tell, task)
        if missed is not None:
            raise ScheduleError(missed)
        leader.core.forward_over(task)
        leader.ordering.forward_over(leader.tell, task)
        task.phase = "B"
        self.held.append(mb)
        if not self.leader.backward_may_start():
            return []
        due, self.held = sorted(self.held), []
        return due

    def _loss_fetched(self, mb: int) -> None:
        """The leader has the last stage's outputs of ``mb``: its task turns to its backward,
        and each one ``simple``'s hold lets go asks for the token to begin it."""
        for due in self._forward_over(mb):
            self.requesting.add(due)
            task = self.tasks[due]
            task.remote_nodes[self.route[self.last]] += 1  # not terminal yet
            self._ask(0, Stream(task, ["B"], 0))

    # --- messages ------------------------------------------------------------------------------

    def _send_forward(self, stage: int, mb: int) -> None:
        """``mb``'s activations go to the next stage; arriving at the last one, the leader's
        backward request travels with them (once ``simple``'s hold lets it)."""
        task, following = self.tasks[mb], stage + 1
        comm, owner = self.costs.comm, self.route[following]
        if owner == 0:  # back to the leader's task: its output joins the task's graph
            task.remote_nodes[self.route[stage]] += 1
            self._at(comm, lambda: self._ask(0, Stream(task, ["F"], following)))
            return
        leader = self.ranks[0]
        leader.ordering.moved_on(leader.tell, task, owner)
        stream = Stream(Work("serve", mb, "F", step=STEP), ["F"], following)
        self._at(comm, lambda: self._arrive(owner, stream))
        if following == self.last and not self.fetched_loss:
            due = self._forward_over(mb)
            if mb in due:
                stream.phases.append(self._backward_phase(following, mb))
                due.remove(mb)
            for other in due:
                self._at(comm, functools.partial(self._backward, self.last, other))

    def _backward_phase(self, stage: int, mb: int) -> Phase:
        return backward_phases(self.policy.splits_backward(stage, mb))[0]

    def _arrive(self, r: int, stream: Stream) -> None:
        """A message's requests are dispatched: their task is announced, then asks."""
        rank = self.ranks[r]
        rank.core.announce(stream.work)
        rank.streams[stream.work] = stream
        if stream.phases[0] == "F" or stream.work.microbatch in rank.forwards_run:
            self._ask(r, stream)
        else:
            rank.parked.append(stream)

    def _backward(self, stage: int, mb: int) -> None:
        phase = self._backward_phase(stage, mb)
        stream = Stream(Work("serve", mb, phase, step=STEP), [phase], stage)
        self._arrive(self.route[stage], stream)

    def _gradients_arrived(self, stage: int, mb: int) -> None:
        if self.route[stage] > 0:
            self._backward(stage, mb)
        else:
            self._ask(0, Stream(self.tasks[mb], ["B"], stage))

    def _served(self, r: int, stream: Stream, phase: Phase) -> None:
        rank, mb, stage = self.ranks[r], stream.work.microbatch, stream.stage
        if phase == "F":
            rank.forwards_run.add(mb)
            for parked in [s for s in rank.parked if s.work.microbatch == mb]:
                rank.parked.remove(parked)
                self._ask(r, parked)
            if stage < self.last:
                self._send_forward(stage, mb)
            elif self.fetched_loss:
                self._at(self.costs.comm, lambda: self._loss_fetched(mb))
            return
        if phase == "W":
            return
        if phase == "I":
            rank.core.owe(STEP, mb)  # before the reply
        self._at(self.costs.comm, lambda: self._gradients_arrived(stage - 1, mb))
        rank.ordering.backward_over(rank.tell, STEP, mb)  # its last backward request here
        if phase == "I":
            weights = Work("serve", mb, "W", step=STEP)
            self._ask(r, Stream(weights, ["W"], stage))

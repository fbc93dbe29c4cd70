"""The scheduling core driven as the runtime drives it, over simulated time: no threads, no
processes.

One :class:`~dtrain.modelparallel.scheduling.scheduler.Scheduler` per rank gets the calls the
executor makes, in the order it makes them: the leader admits microbatches and queues each task for
the token at once; its task computes its forward, waits (the token is given up, and with a plan
order its forward action ends), turns to its backward once its forward has reached the last
stage (the forward is done everywhere: the others learn it in a notice), and queues for the
token again when the gradients come back. Requests arrive in streams, each served by one task
that is announced on arrival, asks for the token as its thread starts (a backward only once its
forward has run here), keeps the token between its jobs unless outranked, and gives it back
at its end; a split backward owes its weight half before it replies, and the weight half is a
task of its own, paid when it has run. Every computation takes the plan's cost, every message
``costs.comm``.

The pipeline is the chain the plans model: partition ``s`` runs stage ``s``; activations go
from a stage to the next, gradients back. (The runtime relays activations between partitions
other than the leader's through the leader; the model folds the two hops into one message.)
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.rules import Phase, backward_phases
from dtrain.modelparallel.scheduling.schedule import Schedule
from dtrain.modelparallel.scheduling.scheduler import Scheduler, Work

STEP = 1
_INSTANT = 1e-9


def random_costs(rng: random.Random, stages: int) -> Costs:
    """Uneven stages, backwards dearer than forwards on average, some message latency."""
    return Costs.per_stage(
        stages,
        [rng.uniform(0.2, 2.0) for _ in range(stages)],
        [rng.uniform(0.3, 4.0) for _ in range(stages)],
        rng.choice([0.0, 0.1, 0.5]),
        0.2,
    )


class RuntimeDeadlock(AssertionError):
    """Work is left and nothing can happen any more; ``turns`` holds each rank's plan turn."""


@dataclass(eq=False)
class Stream:
    """Requests of one microbatch that one message brought a rank, served by one task."""

    work: Work
    phases: list[Phase]
    job: int = 0


@dataclass
class _Rank:
    core: Scheduler
    streams: dict[Work, Stream] = field(default_factory=dict)
    parked: list[Stream] = field(default_factory=list)
    """Announced backward streams whose forward has not run here yet."""
    computing: Stream | None = None
    order: list[tuple[str, int]] = field(default_factory=list)
    forwards_run: set[int] = field(default_factory=set)


class RuntimeModel:
    """Run one step; :meth:`run` returns each rank's computations ``(phase, microbatch)`` in
    the order they started."""

    def __init__(
        self,
        policy: SchedulePolicy,
        stages: int,
        costs: Costs,
        plan: Schedule | None = None,
        moved_on: bool = True,
        fetched_loss: bool = False,
    ) -> None:
        """``plan``: every rank follows its row (``deterministic_server``). Not ``moved_on``:
        a stage learns that its forward of a microbatch is over only once the whole forward
        is (as the runtime did before it said so as the leader's forward moved on).
        ``fetched_loss``: the leader computes the loss from the last stage's outputs, which it
        fetches; its backward then takes its turn on the first stage before it sends the
        backward request (the loss's backward is its own), and keeps it until its task ends."""
        self.policy, self.stages, self.costs = policy, stages, costs
        self.moved_on = moved_on
        self.fetched_loss = fetched_loss and stages > 1
        self.requesting: set[int] = set()
        """Leader tasks whose next computation is their loss's backward, then the request."""
        rows = [None] * stages
        if plan is not None:
            rows = [
                tuple((a.kind, a.microbatch) for a in plan.compute_actions(s))
                for s in range(stages)
            ]
        self.ranks = [
            _Rank(Scheduler(policy, rows[s], rank=s))
            for s in range(stages)  # type: ignore[arg-type]
        ]
        self.leader = self.ranks[0].core
        self.tasks: dict[int, Work] = {}
        """The leader's microbatch tasks."""
        self.held: list[int] = []
        """Microbatches whose backward request waits for ``simple``'s hold."""
        self.now = 0.0
        self._events: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.tied = False
        """A rank handed the token on while something else reached it at the same instant: the
        runtime's order then depends on which thread gets there first."""

    # --- time ----------------------------------------------------------------------------------

    def _at(self, delay: float, stage: int, action: Callable[[], None]) -> None:
        """``action`` happens on ``stage`` after ``delay``."""
        heapq.heappush(self._events, (self.now + delay, next(self._seq), stage, action))

    def run(self) -> list[list[tuple[str, int]]]:
        self.leader.begin_step()
        self._admit()
        while self._events:
            self.now, _, _, action = heapq.heappop(self._events)
            action()
        if self.leader.finished_count < self.policy.microbatches or any(
            r.core.waiting or r.core.weights_owed for r in self.ranks
        ):
            turns = {
                s: r.core.order(STEP).describe() if r.core.plan is not None else "-"
                for s, r in enumerate(self.ranks)
            }
            raise RuntimeDeadlock(f"the pipeline stops; each rank's turn: {turns}")
        return [r.order for r in self.ranks]

    # --- the token -----------------------------------------------------------------------------

    def _grant(self, stage: int) -> None:
        rank = self.ranks[stage]
        work = rank.core.grant()
        if work is not None:
            self.tied |= any(e[2] == stage and e[0] <= self.now + _INSTANT for e in self._events)
            self._compute(stage, rank.streams[work])

    def _compute(self, stage: int, stream: Stream) -> None:
        rank, work = self.ranks[stage], stream.work
        where = rank.core.off_plan(work)
        if where is not None:
            raise AssertionError(f"{work.describe()} would compute {where}")
        rank.computing = stream
        if rank.order[-1:] != [(work.phase, work.microbatch)]:  # one action's periods once
            rank.order.append((work.phase, work.microbatch))
        cost = 0.0 if stage == 0 and work.microbatch in self.requesting else None
        cost = self.costs.of(work.phase, stage) if cost is None else cost
        self._at(cost, stage, lambda: self._computed(stage, stream))

    def _ask(self, stage: int, stream: Stream) -> None:
        """The stream's task asks for the token (its thread started, or it waited)."""
        rank = self.ranks[stage]
        rank.streams[stream.work] = stream
        rank.core.submit(stream.work)
        self._grant(stage)

    def _release(self, stage: int, work: Work) -> None:
        rank = self.ranks[stage]
        rank.core.release(work)
        rank.computing = None
        self._grant(stage)

    def _computed(self, stage: int, stream: Stream) -> None:
        rank, work = self.ranks[stage], stream.work
        rank.core.between(work)
        phase = work.phase
        stream.job += 1
        if stage == 0:
            self._leader_computed(work)
            return
        self._served(stage, work, phase)
        if stream.job < len(stream.phases):  # its next job: kept unless outranked
            work.phase = stream.phases[stream.job]
            if rank.core.outranked(work):
                self._release(stage, work)
                self._ask(stage, stream)
            else:
                rank.core.resume(work)
                self._compute(stage, stream)
            return
        self._release(stage, work)
        if phase == "W":
            rank.core.paid(STEP, work.microbatch)
            self._grant(stage)

    # --- the leader ----------------------------------------------------------------------------

    def _admit(self) -> None:
        leader = self.leader
        while leader.admitted < self.policy.microbatches and leader.may_admit():
            mb = leader.admit()
            work = Work("leader", mb, "F", step=STEP)
            self.tasks[mb] = work
            self._ask(0, Stream(work, ["F"]))

    def _leader_computed(self, work: Work) -> None:
        mb = work.microbatch
        if work.phase == "B" and mb in self.requesting:  # it waits for the last stage
            self.requesting.discard(mb)
            work.remote_nodes.clear()
            self._release(0, work)
            last = self.stages - 1
            self._at(self.costs.comm, last, lambda: self._backward(last, mb))
            return
        if work.phase == "B":  # the task ends: the next microbatch is admitted first
            self.leader.release(work)
            self.leader.finished(work)
            self._notify(range(1, self.stages), lambda core: core.end_microbatch(STEP, mb))
            self._admit()
            self._grant(0)
            return
        if self.stages == 1:  # its backward follows here, kept unless outranked or held
            due = self._start_backward(mb)
            if mb not in due:
                self._release(0, work)
            for other in sorted(due, key=lambda m: m == mb):  # its own last: it holds the token
                self._gradients_arrived(0, other)
            return
        self.ranks[0].core.waits(work)  # it waits for the next stage: its forward ends here
        self._release(0, work)
        self._send_forward(0, mb)

    def _start_backward(self, mb: int) -> list[int]:
        """The leader's task turns to its backward: the forward is over on every rank (the
        others learn it in a notice after the requests). The microbatches whose backward
        ``simple``'s hold lets begin now."""
        self.leader.forward_done(mb)
        self.leader.end_action(STEP, "F", mb)
        self._notify(range(1, self.stages), lambda core: core.end_action(STEP, "F", mb))
        self.tasks[mb].phase = "B"
        self.held.append(mb)
        if not self.leader.backward_may_start():
            return []
        due, self.held = sorted(self.held), []
        return due

    def _notify(self, stages: range, end: Callable[[Scheduler], bool]) -> None:
        """The leader's notice reaches ``stages`` (sent only with a plan order)."""
        if self.leader.plan is None:
            return
        for stage in stages:
            core = self.ranks[stage].core

            def arrive(stage: int = stage, core: Scheduler = core) -> None:
                if end(core):
                    self._grant(stage)

            self._at(self.costs.comm, stage, arrive)

    # --- served work ---------------------------------------------------------------------------

    def _send_forward(self, stage: int, mb: int) -> None:
        """``mb``'s activations go to the next stage; arriving at the last one, the leader's
        backward request travels with them (once ``simple``'s hold lets it)."""
        last = self.stages - 1
        stream = Stream(Work("serve", mb, "F", step=STEP), ["F"])
        self._at(self.costs.comm, stage + 1, lambda: self._arrive(stage + 1, stream))
        if stage > 0 and self.moved_on:  # the leader's forward moves on from here: it says so
            self._notify(range(stage, stage + 1), lambda core: core.end_action(STEP, "F", mb))
        if stage + 1 == last and not self.fetched_loss:
            # Its backward request, then the held ones, follow the activations.
            due = self._start_backward(mb)
            if mb in due:
                stream.phases.append(self._backward_phase(last, mb))
                due.remove(mb)
            for other in due:
                self._at(self.costs.comm, last, lambda other=other: self._backward(last, other))

    def _loss_fetched(self, mb: int) -> None:
        """The leader has the last stage's outputs of ``mb``: its task turns to its backward,
        and each one ``simple``'s hold lets go asks for the token to begin it."""
        for due in self._start_backward(mb):
            self.requesting.add(due)
            self.tasks[due].remote_nodes[self.stages - 1] += 1  # not terminal yet
            self._ask(0, Stream(self.tasks[due], ["B"]))

    def _backward_phase(self, stage: int, mb: int) -> Phase:
        return backward_phases(self.policy.splits_backward(stage, mb))[0]

    def _arrive(self, stage: int, stream: Stream) -> None:
        """A message's requests are dispatched: their task is announced, then asks."""
        rank = self.ranks[stage]
        rank.core.announce(stream.work)
        rank.streams[stream.work] = stream
        if stream.phases[0] == "F" or stream.work.microbatch in rank.forwards_run:
            self._ask(stage, stream)
        else:
            rank.parked.append(stream)

    def _backward(self, stage: int, mb: int) -> None:
        phase = self._backward_phase(stage, mb)
        self._arrive(stage, Stream(Work("serve", mb, phase, step=STEP), [phase]))

    def _gradients_arrived(self, stage: int, mb: int) -> None:
        if stage > 0:
            self._backward(stage, mb)
            return
        work = self.tasks[mb]
        rank = self.ranks[0]
        if rank.core.holder is work:  # one stage: kept from its forward unless outranked
            if rank.core.outranked(work):
                self._release(0, work)
                self._ask(0, Stream(work, ["B"]))
            else:
                rank.core.resume(work)
                self._compute(0, Stream(work, ["B"]))
            return
        self._ask(0, Stream(work, ["B"]))

    def _served(self, stage: int, work: Work, phase: Phase) -> None:
        rank, mb = self.ranks[stage], work.microbatch
        if phase == "F":
            rank.forwards_run.add(mb)
            for stream in [s for s in rank.parked if s.work.microbatch == mb]:
                rank.parked.remove(stream)
                self._ask(stage, stream)
            if stage < self.stages - 1:
                self._send_forward(stage, mb)
            elif self.fetched_loss:
                self._at(self.costs.comm, 0, lambda: self._loss_fetched(mb))
            return
        if phase == "W":
            return
        if phase == "I":
            rank.core.owe(STEP, mb)  # before the reply
        self._at(self.costs.comm, stage - 1, lambda: self._gradients_arrived(stage - 1, mb))
        rank.core.end_backward(STEP, mb)  # the microbatch's last backward request here
        if phase == "I":
            weights = Work("serve", mb, "W", step=STEP)
            self._ask(stage, Stream(weights, ["W"]))

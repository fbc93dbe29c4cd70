"""Pipeline schedules as data: per-rank action lists, a simulator and a checker.

Chain abstraction: partition ``p`` is pipeline stage ``p``, run by pp rank ``p``. Microbatch ``mb``
goes forward through stages ``0..P-1`` and backward through ``P-1..0``. A :class:`Schedule` lists,
per rank, the order in which that rank runs forwards (``F``), backwards (``B``) and the sends and
receives between neighbouring stages. A real run's timeline turns into the same form
(:func:`recorded_schedule`), so a plan and a measured run are checked, simulated and exported
(Chrome trace) by the same code, and schedules can be tested without a model or processes.

The runtime keeps a pipeline's rules (which work exists, its dependencies, ``simple``'s forwards
before backwards, the in-flight bound, backward priority) but is work-conserving: a rank never
idles waiting for the plan's next microbatch while another one is ready, so among ready
microbatches its order can differ from the plan's. Tests check recorded runs with :func:`check`.

What each action needs (the chain's dependencies, its messages, which work counts as a
backward, what is in flight) is one table, :mod:`.rules`, read by the planner, the simulator and
the checker alike. Which rules a schedule follows is its :class:`~.policy.SchedulePolicy`, the
object the runtime asks too; the plans here are made by the runtime's own per-rank
:class:`~.scheduler.Scheduler` (the token's choice, admission, the backward hold, the terminal
rule), one per stage, and the checker checks against the policy.

The two pipelines of SMP v1 (``pipeline`` parameter):

* ``simple`` (GPipe): every forward, then every backward. Every microbatch's activations are alive
  at once (in flight = ``microbatches``). Backwards run in microbatch order (B0, B1, ...), not
  reversed, as SMP's SimplePipeline runs ``F0 F1 B0 B1``. The makespan is the same either way.
* ``interleaved`` (backward first, 1F1B-like): rank ``s`` runs a warm-up of
  ``min(active_microbatches, P - s, microbatches)`` forwards, then alternates one backward and one
  forward, then drains the remaining backwards. ``P - s`` forwards are what rank ``s`` needs in
  flight to keep busy until the first gradient comes back; ``active_microbatches`` caps memory.

As in SMP, ``simple`` is forced to ``interleaved`` when ``active_microbatches < microbatches``:
``simple`` keeps all microbatches in flight, which that bound forbids. With SMP's default
``active_microbatches = stages + 2`` this happens whenever ``microbatches > stages + 2``.

Sends are buffered (the runtime's receiver thread takes every message as it arrives), so a send
never blocks its rank; a receive waits until the matching send's message has arrived.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from dtrain.modelparallel.scheduling.policy import SchedulePolicy, check_pipeline
from dtrain.modelparallel.scheduling.rules import (
    Flight,
    Phase,
    backward_phases,
    is_gradient,
    ordering_pairs,
    ready_at,
    receives,
    sends,
)
from dtrain.modelparallel.scheduling.scheduler import Scheduler, Work
from dtrain.modelparallel.timeline import TimelineEvent

ActionKind = Literal["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
KINDS: tuple[str, ...] = get_args(ActionKind)
COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "I", "W")
_BACKWARD_HALVES = ("B", "I", "W")
_MESSAGE_KINDS = ("RECV_F", "SEND_F", "RECV_B", "SEND_B")
_NO_PEER = {
    "RECV_F": "stage 0 has no previous stage",
    "SEND_B": "stage 0 has no previous stage",
    "SEND_F": "the last stage has no next stage",
    "RECV_B": "the last stage has no next stage",
}
"""Why a message of each kind has nobody at the other end, where it has not."""

_ACTION_TEXT = re.compile(r"^(?:(\d+):)?(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class ScheduleError(ValueError):
    """A schedule breaks a rule (missing or repeated work, bad order, too many in flight)."""


class ScheduleDeadlock(ScheduleError):
    """No rank can make progress; ``blocked`` maps each stuck rank to its action and its wait."""

    def __init__(self, blocked: dict[int, tuple[Action, str]]) -> None:
        self.blocked = blocked
        details = "; ".join(
            f"rank {rank} is blocked at {action} waiting for {waits_for}"
            for rank, (action, waits_for) in sorted(blocked.items())
        )
        super().__init__(f"schedule deadlocks, no rank can progress: {details}")


@dataclass(frozen=True)
class Action:
    """One step of one rank: compute ``F``/``B`` or a send/receive of microbatch ``microbatch``.

    A split backward is two actions: ``I`` computes the gradients of the stage's inputs (what
    the previous stage waits for, sent right after), ``W`` those of its weights (needed only by
    the optimizer step).

    ``stage`` is the stage the action belongs to (the rank running it, in the chain abstraction);
    it prints as ``F3`` / ``SEND_F3`` because the row of a schedule already says the rank.
    """

    kind: ActionKind
    microbatch: int
    stage: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind: got {self.kind!r}; allowed: {', '.join(KINDS)}")
        for name in ("microbatch", "stage"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"Action {name}: got {value!r}; must be an integer >= 0")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @classmethod
    def parse(cls, text: str, stage: int) -> Action:
        """``"F3"`` -> ``Action("F", 3, stage)``; ``"1:F3"`` names the stage explicitly."""
        match = _ACTION_TEXT.match(text.strip())
        if not match:
            raise ValueError(
                f"action: got {text!r}; expected a kind ({', '.join(KINDS)}) then a microbatch, "
                "e.g. 'F3' or 'SEND_B0'"
            )
        explicit_stage, kind, microbatch = match.groups()
        return cls(kind, int(microbatch), int(explicit_stage) if explicit_stage else stage)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``actions[r]`` is what rank ``r`` runs, strictly in that order."""

    pipeline: str
    stages: int
    microbatches: int
    active_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        check_pipeline(self.pipeline)
        for name in ("stages", "microbatches", "active_microbatches"):
            _check_positive_int(name, getattr(self, name))
        if self.active_microbatches > self.microbatches:
            raise ValueError(
                f"active_microbatches: got {self.active_microbatches}; allowed: 1 to "
                f"microbatches ({self.microbatches})"
            )
        if self.pipeline == "simple" and self.active_microbatches < self.microbatches:
            raise ValueError(
                f"pipeline 'simple' needs active_microbatches == microbatches "
                f"({self.microbatches}), got {self.active_microbatches}; SMP runs it as "
                "'interleaved' then"
            )
        actions = tuple(tuple(rank_actions) for rank_actions in self.actions)
        object.__setattr__(self, "actions", actions)
        if len(actions) != self.stages:
            raise ValueError(
                f"actions: got {len(actions)} rank lists; need one per stage ({self.stages})"
            )
        for rank, rank_actions in enumerate(actions):
            for action in rank_actions:
                if not isinstance(action, Action):
                    raise ValueError(f"actions[{rank}]: got {action!r}; expected an Action")
                if action.microbatch >= self.microbatches or action.stage >= self.stages:
                    raise ValueError(
                        f"actions[{rank}]: {action!r} is outside {self.stages} stages x "
                        f"{self.microbatches} microbatches"
                    )

    @property
    def policy(self) -> SchedulePolicy:
        """The rules this schedule follows: each stage splits as many backwards as it has
        ``I`` actions (a plan's are its last microbatches')."""
        split = tuple(sum(a.kind == "I" for a in rank_actions) for rank_actions in self.actions)
        return SchedulePolicy(self.pipeline, self.microbatches, self.active_microbatches, split)

    def compute_actions(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s ``F``/``B`` actions in order (sends and receives left out)."""
        return tuple(action for action in self.actions[rank] if action.is_compute)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; actions are written compactly (``"F3"``), one list per rank."""
        return {
            "pipeline": self.pipeline,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "active_microbatches": self.active_microbatches,
            "actions": [
                [str(a) if a.stage == rank else f"{a.stage}:{a}" for a in rank_actions]
                for rank, rank_actions in enumerate(self.actions)
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        return cls(
            pipeline=data["pipeline"],
            stages=data["stages"],
            microbatches=data["microbatches"],
            active_microbatches=data["active_microbatches"],
            actions=tuple(
                tuple(Action.parse(text, rank) for text in rank_actions)
                for rank, rank_actions in enumerate(data["actions"])
            ),
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        """A grid, one row per rank, one column per unit of time: a forward takes one, a
        backward two (``-`` continues it), each half of a split backward one; no comm latency.

        Time-aligned so the pipeline's fill and drain (its bubbles, shown as ``.``) are visible.
        """
        header = (
            f"{self.pipeline} pipeline: {self.stages} stages, {self.microbatches} microbatches, "
            f"at most {self.active_microbatches} in flight"
        )
        label = f"rank {{:>{len(str(self.stages - 1))}}}"
        try:
            result = simulate(self)
        except ScheduleDeadlock as error:
            rows = [
                f"{label.format(rank)} | " + " ".join(map(str, rank_actions))
                for rank, rank_actions in enumerate(self.actions)
            ]
            return "\n".join([f"{header} (deadlocks; actions in list order)", *rows, str(error)])
        cells: list[dict[int, str]] = [
            {
                round(e.start) + column: e.name if column == 0 else "-"
                for e in rank_events
                if e.kind in COMPUTE_KINDS
                for column in range(round(e.duration))
            }
            for rank_events in result.events
        ]
        width = max((len(name) for row in cells for name in row.values()), default=1)
        columns = round(result.makespan)
        rows = [
            f"{label.format(rank)} | "
            + " ".join(row.get(t, ".").ljust(width) for t in range(columns)).rstrip()
            for rank, row in enumerate(cells)
        ]
        return "\n".join([header, *rows])


@dataclass(frozen=True)
class Costs:
    """What a stage's work on one microbatch costs, in plans and simulations.

    ``forward[s]`` and ``backward[s]`` per stage; ``comm`` the latency of a message between
    neighbouring stages; a split backward's halves (``I``, ``W``) cost
    ``backward[s] × (1 + split_overhead) / 2`` each: on a CPU the two took 1.19× the whole
    (the benchmark LM's last stage: 30.6 against 25.7 ms), which is why not every backward
    is split.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    comm: float = 0.0
    split_overhead: float = 0.0

    @classmethod
    def per_stage(
        cls,
        stages: int,
        forward_cost: Sequence[float] | float = 1.0,
        backward_cost: Sequence[float] | float = 2.0,
        comm_cost: float = 0.0,
        split_overhead: float = 0.0,
    ) -> Costs:
        """Costs from one number for every stage, or one per stage (checked)."""
        for name, value in (("comm_cost", comm_cost), ("split_overhead", split_overhead)):
            if not _is_number(value) or value < 0 or not math.isfinite(value):
                raise ValueError(f"{name}: got {value!r}; must be a finite number >= 0")
        return cls(
            _per_stage("forward_cost", forward_cost, stages),
            _per_stage("backward_cost", backward_cost, stages),
            float(comm_cost),
            float(split_overhead),
        )

    @classmethod
    def of_stages(cls, times: Sequence[float], split_overhead: float = 0.0) -> Costs:
        """Costs from each stage's forward-and-backward time (a partition plan's), the
        backward taken as twice the forward; unknown (zero) times count as equal stages."""
        if not all(_is_number(t) and t > 0 for t in times):
            times = [1.0] * len(times)
        return cls.per_stage(
            len(times),
            [t / 3 for t in times],
            [2 * t / 3 for t in times],
            split_overhead=split_overhead,
        )

    def of(self, kind: str, stage: int) -> float:
        """The time of one compute action of ``kind`` on ``stage``."""
        if kind == "F":
            return self.forward[stage]
        if kind == "B":
            return self.backward[stage]
        return self.backward[stage] * (1.0 + self.split_overhead) / 2


SPLIT_OVERHEAD = 0.2
"""What plans assume a split backward costs beyond the whole (see :class:`Costs`)."""


def build_schedule(
    pipeline: str,
    stages: int,
    microbatches: int,
    active_microbatches: int | None = None,
    split_backward: bool = True,
    costs: Costs | None = None,
) -> Schedule:
    """The action lists SMP's ``pipeline`` runs on ``stages`` ranks for ``microbatches``: what
    the runtime's :class:`~.policy.SchedulePolicy` does when the work costs ``costs``
    (default: forward 1, backward 2 on every stage, halves a fifth dearer, no latency).

    ``active_microbatches`` defaults to ``stages + 2`` (SMP's default) and is clamped to
    ``microbatches``, since no more than that can ever be in flight. ``simple`` with
    ``active_microbatches < microbatches`` is built as ``interleaved`` (SMP's rule): check
    ``Schedule.pipeline`` for the pipeline actually used. With ``split_backward`` the
    backwards :func:`zero_bubble_policy` chooses are ``I``, its send, and a ``W`` placed where
    the stage would otherwise wait.
    """
    check_pipeline(pipeline)
    _check_positive_int("stages", stages)
    _check_positive_int("microbatches", microbatches)
    if active_microbatches is None:
        active_microbatches = stages + 2
    else:
        _check_positive_int("active_microbatches", active_microbatches)
    if costs is None:
        costs = Costs.per_stage(stages, split_overhead=SPLIT_OVERHEAD)
    policy = SchedulePolicy.for_config(pipeline, microbatches, active_microbatches)
    if split_backward:
        policy = zero_bubble_policy(policy, stages, costs)
    return schedule_of(policy, stages, costs)


def zero_bubble_policy(policy: SchedulePolicy, stages: int, costs: Costs) -> SchedulePolicy:
    """``policy`` with the backwards split whose weight halves shorten the step most.

    A stage's weight halves, run when nothing else is ready, fill the drain, where the stage
    would wait while the stages before it do their last backwards; the sooner input halves
    also start those backwards sooner. Each split costs ``costs.split_overhead``. From the
    last stage to the second, each stage's count of split backwards (among the step's last
    microbatches) is the one whose plan ends soonest, the fewest among equals; the first
    stage sends no gradients and never splits.
    """
    best = policy
    best_time = _run_policy(best, stages, costs)[1]
    for stage in range(stages - 1, 0, -1):
        for count in range(1, min(policy.microbatches, 2 * stage + 2) + 1):
            split = [*best.split, *[0] * (stages - len(best.split))]
            split[stage] = count
            candidate = replace(best, split=tuple(split))
            makespan = _run_policy(candidate, stages, costs)[1]
            if makespan < best_time * (1 - 1e-9):
                best, best_time = candidate, makespan
    return best


def schedule_of(policy: SchedulePolicy, stages: int, costs: Costs) -> Schedule:
    """The action lists ``policy`` runs on ``stages`` ranks when the work costs ``costs``."""
    order, _ = _run_policy(policy, stages, costs)
    actions = tuple(
        tuple(
            action for kind, mb in rank_order for action in _with_messages(kind, mb, stage, stages)
        )
        for stage, rank_order in enumerate(order)
    )
    return Schedule(policy.pipeline, stages, policy.microbatches, policy.active, actions)


def _run_policy(
    policy: SchedulePolicy, stages: int, costs: Costs
) -> tuple[list[list[tuple[str, int]]], float]:
    """Each rank's compute actions in the order the runtime runs them under ``policy``, and
    when the last one ends.

    One :class:`~.scheduler.Scheduler` per stage, the runtime's own, decides: work asks it for
    the token when it is ready, a free stage computes what it grants, and the leader (stage 0)
    admits microbatches while it lets it (a microbatch finishes with its backward on stage 0).
    What this adds is a model of times: an activation reaches the next stage ``costs.comm``
    after its forward ends, a gradient the previous stage ``costs.comm`` after its (input)
    backward; the last stage's backward request travels with the forward, and the leader's
    hold (``simple``) counts a forward done once it has reached the last stage.
    """
    microbatches = policy.microbatches
    last = stages - 1
    cores = [Scheduler(policy, rank=stage) for stage in range(stages)]
    leader = cores[0]
    leader.begin_step()
    # Work that will be ready: (time, order, stage, work).
    pending: list[tuple[float, int, int, Work]] = []
    compute_end: dict[tuple[str, int, int], float] = {}
    requested: dict[int, float] = {}
    """When the last stage gets each microbatch's backward request."""
    submitted: set[tuple[str, int, int]] = set()
    running: list[tuple[Work, float] | None] = [None] * stages
    order: list[list[tuple[str, int]]] = [[] for _ in range(stages)]
    ends = [0.0] * stages
    counter = itertools.count()

    def phases(mb: int, stage: int) -> tuple[Phase, ...]:
        """The work ``mb`` has on ``stage``."""
        return ("F", *backward_phases(stage > 0 and policy.splits_backward(stage, mb)))

    def offer(mb: int, stage: int) -> None:
        """Put ``mb``'s work on ``stage`` whose needs are met in line for when they are."""
        for phase in phases(mb, stage):
            if (phase, mb, stage) in submitted or (phase, stage) == ("F", 0):
                continue  # the leader admits its forwards
            ready, _ = ready_at(
                phase, mb, stage, stages, lambda k, m, s: compute_end.get((k, m, s)), costs.comm
            )
            if ready is not None and stage == last and is_gradient(phase):
                ready = None if mb not in requested else max(ready, requested[mb])
            if ready is not None:
                submitted.add((phase, mb, stage))
                work = Work("leader" if stage == 0 else "serve", mb, phase)
                heapq.heappush(pending, (ready, next(counter), stage, work))

    def forward_arrived(mb: int, time: float) -> None:
        """``mb``'s forward reached the last stage: once the leader's hold lets backwards
        start, the backward requests of every arrived forward go out."""
        leader.forward_done(mb)
        if leader.backward_may_start():
            for m in sorted(leader.forwards_done - requested.keys()):
                requested[m] = time
                offer(m, last)

    def ended(stage: int, done: Work, end: float) -> None:
        mb = done.microbatch
        compute_end[(done.phase, mb, stage)] = end
        for neighbour in (stage - 1, stage, stage + 1):
            if 0 <= neighbour < stages:
                offer(mb, neighbour)
        if done.phase == "F" and stage == max(last - 1, 0):
            forward_arrived(mb, end + (costs.comm if stage < last else 0.0))
        if stage == 0 and is_gradient(done.phase):
            leader.finished(done)

    now = 0.0
    while True:
        for stage, core in enumerate(cores):
            current = running[stage]
            if current is not None and current[1] <= now:
                running[stage] = None
                core.release(current[0])
                ended(stage, current[0], current[1])
        while pending and pending[0][0] <= now:
            _, _, stage, ready = heapq.heappop(pending)
            cores[stage].submit(ready)
        while leader.admitted < microbatches and leader.may_admit():
            mb = leader.admit()
            submitted.add(("F", mb, 0))
            leader.submit(Work("leader", mb, "F"))
        for stage, core in enumerate(cores):
            chosen = core.grant()
            if chosen is not None:
                end = now + costs.of(chosen.phase, stage)
                running[stage] = (chosen, end)
                order[stage].append((chosen.phase, chosen.microbatch))
                ends[stage] = end
        times = [r[1] for r in running if r is not None] + [p[0] for p in pending[:1]]
        if not times:
            break
        now = max(now, min(times))
    if leader.finished_count < microbatches or any(core.waiting for core in cores):
        raise ScheduleError(f"the {policy.pipeline} policy stalls: no rank can go on")
    return order, max(ends, default=0.0)


def recorded_schedule(
    events: Iterable[TimelineEvent],
    pipeline: str,
    stages: int,
    microbatches: int,
    active_microbatches: int,
) -> Schedule:
    """What a real run computed, as a schedule that :func:`check` and :func:`build_schedule`'s
    plans can be compared with.

    Each rank's forwards and backwards in the order they started (a task may compute in several
    periods, e.g. a backward that waited for the next stage's gradients: its first counts), with
    the sends and receives of the chain abstraction around them. Meaningful for a chain of
    partitions (stage ``s`` on pp rank ``s``), which is how the schedules are defined.
    """
    starts: dict[int, dict[tuple[str, int], float]] = {rank: {} for rank in range(stages)}
    for event in events:
        if event.kind in COMPUTE_KINDS:
            first = starts[event.rank]
            key = (event.kind, event.microbatch)
            first[key] = min(first.get(key, math.inf), event.start)
    actions = []
    for rank, first in starts.items():
        rank_actions: list[Action] = []
        for kind, mb in sorted(first, key=first.__getitem__):
            rank_actions += _with_messages(kind, mb, rank, stages)
        actions.append(tuple(rank_actions))
    return Schedule(pipeline, stages, microbatches, active_microbatches, tuple(actions))


def _with_messages(kind: str, mb: int, stage: int, stages: int) -> list[Action]:
    """A compute action (planned, or a recorded period) with the chain's messages around it:
    the receives of what it needs from other stages, the sends of what they need from it."""
    return [
        Action(k, mb, stage)  # type: ignore[arg-type]
        for k in (*receives(kind, stage, stages), kind, *sends(kind, stage, stages))
    ]


@dataclass(frozen=True)
class SimulationResult:
    """What running a schedule with given costs gives.

    ``events[r]`` holds rank ``r``'s events in execution order: compute spans, sends (instants)
    and receives (from when the rank reached the receive until the message arrived).
    ``peak_in_flight[r]`` is the most microbatches rank ``r`` had in flight at once (forwarded,
    gradients not computed: what ``active_microbatches`` bounds), ``peak_held[r]`` the most it
    held activations for (also a split backward's until its weight half, see
    :class:`~.rules.Flight`); ``busy[r]`` its total compute time.
    """

    events: tuple[tuple[TimelineEvent, ...], ...]
    makespan: float
    peak_in_flight: tuple[int, ...]
    peak_held: tuple[int, ...]
    busy: tuple[float, ...]

    def all_events(self, include_comm: bool = True) -> list[TimelineEvent]:
        """Every rank's events, ordered by start time (then rank)."""
        events = [
            event
            for rank_events in self.events
            for event in rank_events
            if include_comm or event.kind in COMPUTE_KINDS
        ]
        return sorted(events, key=lambda event: (event.start, event.rank))

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time spent idle: ``1 - sum(busy) / (ranks x makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimulationResult:
    """Run the action lists in order, each rank one worker, and time them.

    ``costs`` default to forward 1 and backward 2 on every stage, no latency (see
    :class:`Costs`): ``F(mb, s)`` starts at least ``costs.comm`` after ``F(mb, s-1)`` ends,
    ``B(mb, s)`` likewise after ``B(mb, s+1)``, and a receive completes ``costs.comm`` after
    its matching send. Sends and receives take no worker time. Raises
    :class:`ScheduleDeadlock` when every unfinished rank waits on something that never happens.
    """
    stages = schedule.stages
    if costs is None:
        costs = Costs.per_stage(stages)
    elif len(costs.forward) != stages or len(costs.backward) != stages:
        raise ValueError(f"costs: got {len(costs.forward)} stages; the schedule has {stages}")
    comm_cost = costs.comm

    compute_end: dict[tuple[str, int, int], float] = {}  # (kind, mb, stage) -> end
    arrivals: dict[tuple[str, int, int], list[float]] = {}  # (F|B, mb, sending stage) -> times
    received: dict[tuple[str, int, int], int] = {}  # (F|B, mb, sending stage) -> receives done
    position = [0] * stages
    free_at = [0.0] * stages
    events: list[list[TimelineEvent]] = [[] for _ in range(stages)]
    flights = [Flight() for _ in range(stages)]
    busy = [0.0] * stages

    def ended(kind: str, mb: int, stage: int) -> float | None:
        return compute_end.get((kind, mb, stage))

    def ready_time(action: Action) -> tuple[float | None, str]:
        """When ``action``'s inputs are there (None: not yet), and what it waits for."""
        mb, stage = action.microbatch, action.stage
        if action.kind in ("RECV_F", "RECV_B"):
            direction = action.kind[-1]
            sender = stage - 1 if direction == "F" else stage + 1
            needed = f"SEND_{direction}{mb} from rank {sender}"
            if not 0 <= sender < stages:
                return None, f"{needed}, which does not exist"
            key = (direction, mb, sender)
            times = arrivals.get(key, [])
            index = received.get(key, 0)
            return (times[index] if index < len(times) else None), needed
        ready, missing = ready_at(action.kind, mb, stage, stages, ended, comm_cost)
        return ready, "" if missing is None else missing.describe(mb, stage)

    def run(rank: int, action: Action, ready: float) -> None:
        start = max(free_at[rank], ready)
        mb, stage = action.microbatch, action.stage
        end = start
        if action.is_compute:
            end = start + costs.of(action.kind, stage)
            flights[rank].start(action.kind, mb)
        elif action.kind in ("SEND_F", "SEND_B"):
            arrivals.setdefault((action.kind[-1], mb, stage), []).append(start + comm_cost)
        else:
            direction = action.kind[-1]
            key = (direction, mb, stage - 1 if direction == "F" else stage + 1)
            received[key] = received.get(key, 0) + 1
            start = free_at[rank]  # the event shows the wait
        if action.is_compute:
            compute_end.setdefault((action.kind, mb, stage), end)
            busy[rank] += end - start
        free_at[rank] = end
        events[rank].append(TimelineEvent(rank, action.kind, mb, start, end, str(action)))

    while True:
        progressed = False
        for rank in range(stages):
            rank_actions = schedule.actions[rank]
            while position[rank] < len(rank_actions):
                action = rank_actions[position[rank]]
                ready, _ = ready_time(action)
                if ready is None:
                    break
                run(rank, action, ready)
                position[rank] += 1
                progressed = True
        unfinished = [r for r in range(stages) if position[r] < len(schedule.actions[r])]
        if not unfinished:
            break
        if not progressed:
            blocked = {}
            for rank in unfinished:
                action = schedule.actions[rank][position[rank]]
                blocked[rank] = (action, ready_time(action)[1])
            raise ScheduleDeadlock(blocked)

    return SimulationResult(
        events=tuple(tuple(rank_events) for rank_events in events),
        makespan=max(free_at, default=0.0),
        peak_in_flight=tuple(f.peak for f in flights),
        peak_held=tuple(f.peak_held for f in flights),
        busy=tuple(busy),
    )


def ideal_makespan(stage_costs: Sequence[float], microbatches: int) -> float:
    """Pipeline makespan of the bubble formula: ``max(stage_costs) x (M + P - 1)``.

    ``stage_costs[s]`` is stage ``s``'s forward + backward time for one microbatch. With uniform
    stages and no communication latency it is the exact makespan of both pipelines (``simple``,
    and ``interleaved`` with ``active_microbatches >= min(stages, microbatches)``): fill and
    drain cost ``P - 1`` slots of a stage. With uneven stages (same forward:backward split) it
    is an upper bound, as if every stage were the slowest: what benchmarks compare steps to.
    """
    _check_positive_int("microbatches", microbatches)
    if not stage_costs:
        raise ValueError("stage_costs: got an empty sequence; need one cost per stage")
    costs = _per_stage("stage_costs", stage_costs, len(stage_costs))
    return max(costs) * (microbatches + len(costs) - 1)


def check(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` listing every rule ``schedule`` breaks.

    Rules: each rank runs ``F`` and ``B`` (or its halves ``I`` then ``W``) of each microbatch of
    its own stage exactly once, ``F`` before the backward; every send has exactly one matching
    receive on the neighbouring rank (forward results go to the next stage, gradients to the
    previous), received before use and sent after being computed; ``simple`` runs all forwards
    before any backward; no rank has more than ``active_microbatches`` in flight (forwarded,
    gradients not yet computed: :class:`~.rules.Flight`). Then it must run to the end
    (:class:`ScheduleDeadlock`).
    """
    problems: list[str] = []
    stages = schedule.stages
    policy = schedule.policy
    for rank, rank_actions in enumerate(schedule.actions):
        where = f"rank {rank}"
        positions: dict[tuple[str, int], list[int]] = {}
        for index, action in enumerate(rank_actions):
            if action.stage != rank:
                problems.append(f"{where}: {action} belongs to stage {action.stage}")
            positions.setdefault((action.kind, action.microbatch), []).append(index)
        # Once per microbatch: its forward and the messages of the chain around its work.
        expected = {
            "F",
            *(m for k in ("F", "B") for m in (*receives(k, rank, stages), *sends(k, rank, stages))),
        }
        halves_allowed = [
            [int(k in backward_phases(split)) for k in _BACKWARD_HALVES] for split in (False, True)
        ]
        for mb in range(schedule.microbatches):
            halves = [len(positions.get((kind, mb), [])) for kind in _BACKWARD_HALVES]
            if halves == [0, 0, 0]:
                problems.append(f"{where}: B{mb} missing")
            elif halves not in halves_allowed:
                problems.append(
                    f"{where}: microbatch {mb} needs B{mb}, or I{mb} and W{mb}, once each; got "
                    + ", ".join(f"{n} {k}{mb}" for k, n in zip("BIW", halves, strict=True))
                )
            for kind in ("F", *_MESSAGE_KINDS):
                count = len(positions.get((kind, mb), []))
                if kind not in expected and count:
                    problems.append(f"{where}: unexpected {kind}{mb} ({_NO_PEER[kind]})")
                elif kind in expected and count != 1:
                    problems.append(
                        f"{where}: {kind}{mb} missing"
                        if count == 0
                        else f"{where}: {kind}{mb} appears {count} times"
                    )
            for first, second in ordering_pairs():
                before = positions.get((first, mb), [])
                after = positions.get((second, mb), [])
                if len(before) == 1 and len(after) == 1 and before[0] > after[0]:
                    problems.append(f"{where}: {first}{mb} must come before {second}{mb}")
        kinds = [a.kind for a in rank_actions]
        backwards = [i for i, kind in enumerate(kinds) if is_gradient(kind)]
        if backwards and not policy.backward_may_start(kinds[: backwards[0]].count("F")):
            problems.append(f"{where}: simple pipeline runs a backward before its last forward")
        in_flight = Flight.of((a.kind, a.microbatch) for a in rank_actions).peak
        if in_flight and not policy.may_admit(in_flight - 1):
            problems.append(
                f"{where}: {in_flight} microbatches in flight, more than "
                f"active_microbatches={schedule.active_microbatches}"
            )
    if problems:
        shown = problems[:20]
        more = f"; and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ScheduleError(f"invalid schedule: {'; '.join(shown)}{more}")
    simulate(schedule)


def timeline(
    schedule: Schedule, costs: Costs | None = None, include_comm: bool = False
) -> list[TimelineEvent]:
    """The simulated timeline, ready for :func:`~dtrain.modelparallel.timeline.write_chrome_trace`.

    Compute only by default: receive spans cover idle time and would hide the bubbles.
    """
    return simulate(schedule, costs).all_events(include_comm=include_comm)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive_int(name: str, value: object) -> None:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{name}: got {value!r}; must be a positive integer")


def _per_stage(name: str, cost: Sequence[float] | float, stages: int) -> tuple[float, ...]:
    """One finite, non-negative cost per stage, from a number or a sequence."""
    costs = (cost,) * stages if _is_number(cost) else tuple(cost)  # type: ignore[arg-type]
    if len(costs) != stages:
        raise ValueError(f"{name}: got {len(costs)} costs; need one per stage ({stages})")
    for value in costs:
        if not _is_number(value) or value < 0 or not math.isfinite(value):
            raise ValueError(f"{name}: got {value!r}; costs must be finite numbers >= 0")
    return tuple(float(value) for value in costs)

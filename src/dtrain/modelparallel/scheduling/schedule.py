"""Pipeline schedules as data: per-rank action lists and their simulation (the planner that
makes them is :mod:`.planner`, the checker :mod:`.check`, their costs :mod:`.costs`).

Chain abstraction: partition ``p`` is pipeline stage ``p``, run by pp rank ``p``. Microbatch ``mb``
goes forward through stages ``0..P-1`` and backward through ``P-1..0``. A :class:`Schedule` lists,
per rank, the order in which that rank runs forwards (``F``), backwards (``B``) and the sends and
receives between neighbouring stages. A real run's timeline turns into the same form
(:func:`recorded_schedule`), so a plan and a measured run are checked, simulated and exported
(Chrome trace) by the same code, and schedules can be tested without a model or processes.

The runtime keeps a pipeline's rules (which work exists, its dependencies, ``simple``'s forwards
before backwards, the in-flight bound, backward priority) and, without a plan order, is
work-conserving: a rank never idles waiting for the plan's next microbatch while another one is
ready, so where two pieces of work become ready at the same instant its order can differ from
the plan's. With a plan order (``deterministic_server``, or tensor parallelism) every rank
follows its plan row. Tests check recorded runs with
:func:`~.check.check`.

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

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from dtrain.modelparallel.scheduling.costs import (
    Costs,
    check_positive_int,
    is_int,
)
from dtrain.modelparallel.scheduling.policy import SchedulePolicy, check_pipeline
from dtrain.modelparallel.scheduling.rules import (
    Flight,
    ready_at,
    receives,
    sends,
)
from dtrain.modelparallel.timeline import TimelineEvent

ActionKind = Literal["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]


KINDS: tuple[str, ...] = get_args(ActionKind)


COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "I", "W")


BACKWARD_HALVES = ("B", "I", "W")


MESSAGE_KINDS = ("RECV_F", "SEND_F", "RECV_B", "SEND_B")


NO_PEER = {
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
            if not is_int(value) or value < 0:
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
        explicit_stage, kind, microbatch = match.groups()  # the pattern admits KINDS only
        stage = int(explicit_stage) if explicit_stage else stage
        return cls(kind, int(microbatch), stage)  # type: ignore[arg-type]


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
            check_positive_int(name, getattr(self, name))
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

    def plan_row(self, rank: int) -> tuple[tuple[str, int, int], ...]:
        """Rank ``rank``'s compute actions as plan-order keys ``(kind, microbatch, visit)``
        (what the runtime follows; a chain visits each rank once)."""
        return tuple((action.kind, action.microbatch, 0) for action in self.compute_actions(rank))

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


def recorded_schedule(
    events: Iterable[TimelineEvent],
    pipeline: str,
    stages: int,
    microbatches: int,
    active_microbatches: int,
) -> Schedule:
    """What a real run computed, as a schedule that :func:`~.check.check` and
    :func:`~.planner.build_schedule`'s plans can be compared with.

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
            rank_actions += with_messages(kind, mb, rank, stages)
        actions.append(tuple(rank_actions))
    return Schedule(pipeline, stages, microbatches, active_microbatches, tuple(actions))


def with_messages(kind: str, mb: int, stage: int, stages: int) -> list[Action]:
    """A compute action (planned, or a recorded period) with the chain's messages around it:
    the receives of what it needs from other stages, the sends of what they need from it."""
    return [
        Action(k, mb, stage)  # type: ignore[arg-type]  # the rules give kinds of KINDS only
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


def timeline(
    schedule: Schedule, costs: Costs | None = None, include_comm: bool = False
) -> list[TimelineEvent]:
    """The simulated timeline, ready for :func:`~dtrain.modelparallel.timeline.write_chrome_trace`.

    Compute only by default: receive spans cover idle time and would hide the bubbles.
    """
    return simulate(schedule, costs).all_events(include_comm=include_comm)

"""Plans: the scheduling core (:class:`~.scheduler.Scheduler`) run once per stage over a
discrete-event model of the pipeline's times, so that a plan is the order the runtime's rules
give; and the zero-bubble choice of which backwards to split."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection
from dataclasses import replace

from dtrain.modelparallel.scheduling.costs import (
    Costs,
    check_partitions,
    check_positive_int,
)
from dtrain.modelparallel.scheduling.policy import SchedulePolicy, check_pipeline
from dtrain.modelparallel.scheduling.rules import (
    Phase,
    backward_phases,
    is_gradient,
    ready_at,
)
from dtrain.modelparallel.scheduling.schedule import Schedule, ScheduleError, with_messages
from dtrain.modelparallel.scheduling.scheduler import Scheduler, Work

SPLIT_OVERHEAD = 0.2
"""What plans assume a split backward costs beyond the whole (see :class:`~.costs.Costs`)."""


def build_schedule(
    pipeline: str,
    stages: int,
    microbatches: int,
    active_microbatches: int | None = None,
    split_backward: bool = True,
    costs: Costs | None = None,
    whole_partitions: Collection[int] = (),
) -> Schedule:
    """The action lists SMP's ``pipeline`` runs on ``stages`` ranks for ``microbatches``: what
    the runtime's :class:`~.policy.SchedulePolicy` does when the work costs ``costs``
    (default: forward 1, backward 2 on every stage, halves a fifth dearer, no latency).

    ``active_microbatches`` defaults to ``stages + 2`` (SMP's default) and is clamped to
    ``microbatches``, since no more than that can ever be in flight. ``simple`` with
    ``active_microbatches < microbatches`` is built as ``interleaved`` (SMP's rule): check
    ``Schedule.pipeline`` for the pipeline actually used. With ``split_backward`` the
    backwards :func:`zero_bubble_policy` chooses are ``I``, its send, and a ``W`` placed where
    the stage would otherwise wait; never those of ``whole_partitions`` (stage numbers here),
    whose backwards run whole.
    """
    check_pipeline(pipeline)
    check_positive_int("stages", stages)
    check_positive_int("microbatches", microbatches)
    check_partitions("whole_partitions", whole_partitions, stages)
    if active_microbatches is None:
        active_microbatches = stages + 2
    else:
        check_positive_int("active_microbatches", active_microbatches)
    if costs is None:
        costs = Costs.per_stage(stages, split_overhead=SPLIT_OVERHEAD)
    policy = SchedulePolicy.for_config(pipeline, microbatches, active_microbatches)
    if split_backward:
        policy = zero_bubble_policy(policy, stages, costs, whole_partitions=whole_partitions)
    return schedule_of(policy, stages, costs)


def zero_bubble_policy(
    policy: SchedulePolicy,
    stages: int,
    costs: Costs,
    route: tuple[int, ...] | None = None,
    whole_partitions: Collection[int] = (),
) -> SchedulePolicy:
    """``policy`` with the backwards split whose weight halves shorten the step most (over
    ``route``'s stages, see :func:`route_orders`), none on the partitions (ranks) of
    ``whole_partitions``: theirs run whole (they recompute checkpointed modules, which a split
    would recompute once per autograd call, see :mod:`..pipeline.split_backward`).

    A stage's weight halves, run when nothing else is ready, fill the drain, where the stage
    would wait while the stages before it do their last backwards; the sooner input halves
    also start those backwards sooner. Each split costs ``costs.split_overhead``. From the
    last stage to the second, each stage's count of split backwards (among the step's last
    microbatches) is the one whose plan ends soonest, the fewest among equals; the first
    stage sends no gradients and never splits, nor does the leader's stage of a route. The
    other stages' counts are chosen with those backwards whole, so one plan mixes both.
    """
    ranks = route if route is not None else tuple(range(stages))
    check_partitions("whole_partitions", whole_partitions, max(ranks, default=0) + 1)
    best = policy
    best_time = _run_policy(best, stages, costs, route)[1]
    for stage in range(stages - 1, 0, -1):
        if ranks[stage] == 0 or ranks[stage] in whole_partitions:
            continue
        for count in range(1, min(policy.microbatches, 2 * stage + 2) + 1):
            split = [*best.split, *[0] * (stages - len(best.split))]
            split[stage] = count
            candidate = replace(best, split=tuple(split))
            makespan = _run_policy(candidate, stages, costs, route)[1]
            if makespan < best_time * (1 - 1e-9):
                best, best_time = candidate, makespan
    return best


def schedule_of(policy: SchedulePolicy, stages: int, costs: Costs) -> Schedule:
    """The action lists ``policy`` runs on ``stages`` ranks when the work costs ``costs``."""
    order, _ = _run_policy(policy, stages, costs)
    actions = tuple(
        tuple(
            action
            for kind, mb, _ in rank_order
            for action in with_messages(kind, mb, stage, stages)
        )
        for stage, rank_order in enumerate(order)
    )
    return Schedule(policy.pipeline, stages, policy.microbatches, policy.active, actions)


Visit = tuple[str, int, int]
"""A compute action of a rank: ``(kind, microbatch, visit)`` (see :mod:`.order`)."""


def route_orders(policy: SchedulePolicy, route: tuple[int, ...], costs: Costs) -> list[list[Visit]]:
    """Each rank's compute actions, in order, for a microbatch whose stages run on the ranks
    of ``route`` (stage ``s`` on rank ``route[s]``; ``costs`` per stage): the plan order of a
    model whose forward comes back to the leader after the other partitions, ``(0, 1, 0)``
    for a head tied to the embedding. One core per rank schedules all of that rank's stages,
    as the runtime's one token does; a rank's visits are its stages in forward order."""
    check_route(route)
    return _run_policy(policy, len(route), costs, route)[0]


def check_route(route: tuple[int, ...]) -> None:
    """A route starts on the leader, goes through partitions 1, 2, ... in order, each once,
    and may come back to the leader at the end: the shapes a plan order serves."""
    ranks = max(route, default=0) + 1
    chain = tuple(range(ranks))
    if route not in (chain, (*chain, 0)) or (ranks == 1 and len(route) > 1):
        raise ValueError(
            f"route: got {route}; allowed: partitions 0, 1, ... in order, each once, "
            "then back to partition 0 or not"
        )


def _run_policy(
    policy: SchedulePolicy, stages: int, costs: Costs, route: tuple[int, ...] | None = None
) -> tuple[list[list[Visit]], float]:
    """Each rank's compute actions in the order the runtime runs them under ``policy``, and
    when the last one ends.

    One :class:`~.scheduler.Scheduler` per rank, the runtime's own, decides: work asks it for
    the token when it is ready, a free rank computes what it grants, and the leader (stage 0)
    admits microbatches while it lets it (a microbatch finishes with its backward on stage 0).
    What this adds is a model of times: an activation reaches the next stage ``costs.comm``
    after its forward ends, a gradient the previous stage ``costs.comm`` after its (input)
    backward; the last stage's backward request travels with the forward, and the leader's
    hold (``simple``) counts a forward done once it has reached the last stage. Stage ``s``
    runs on rank ``route[s]`` (default: rank ``s``); a leader's stage after the first is the
    leader's task come back (its backward is not terminal: the earlier stages wait for it).
    """
    microbatches = policy.microbatches
    last = stages - 1
    if route is None:
        route = tuple(range(stages))
    visit_of = [route[:s].count(rank) for s, rank in enumerate(route)]
    cores = [Scheduler(policy, rank=rank) for rank in range(max(route) + 1)]
    leader = cores[0]
    leader.begin_step()
    # Work that will be ready: (time, order, stage, work).
    pending: list[tuple[float, int, int, Work]] = []
    compute_end: dict[tuple[str, int, int], float] = {}
    requested: dict[int, float] = {}
    """When the last stage gets each microbatch's backward request."""
    submitted: set[tuple[str, int, int]] = set()
    running: list[tuple[Work, int, float] | None] = [None] * len(cores)
    order: list[list[Visit]] = [[] for _ in cores]
    ends = [0.0] * len(cores)
    counter = itertools.count()

    def phases(mb: int, stage: int) -> tuple[Phase, ...]:
        """The work ``mb`` has on ``stage`` (the leader's backwards are never split)."""
        return ("F", *backward_phases(route[stage] > 0 and policy.splits_backward(stage, mb)))

    def work(mb: int, phase: Phase, stage: int) -> Work:
        rank = route[stage]
        done = Work("leader" if rank == 0 else "serve", mb, phase, visit=visit_of[stage])
        if rank == 0 and stage > 0:
            done.remote_nodes[route[stage - 1]] += 1
        return done

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
                heapq.heappush(pending, (ready, next(counter), stage, work(mb, phase, stage)))

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
        if done.phase == "F" and route[last] == 0 and stage == last:
            forward_arrived(mb, end)  # the leader's own task turns to its backward
        elif done.phase == "F" and route[last] > 0 and stage == max(last - 1, 0):
            forward_arrived(mb, end + (costs.comm if stage < last else 0.0))
        if stage == 0 and is_gradient(done.phase):
            leader.finished(done)

    stage_of: dict[Work, int] = {}
    now = 0.0
    while True:
        for rank, core in enumerate(cores):
            current = running[rank]
            if current is not None and current[2] <= now:
                running[rank] = None
                core.release(current[0])
                ended(current[1], current[0], current[2])
        while pending and pending[0][0] <= now:
            _, _, stage, ready = heapq.heappop(pending)
            stage_of[ready] = stage
            cores[route[stage]].submit(ready)
        while leader.admitted < microbatches and leader.may_admit():
            mb = leader.admit()
            submitted.add(("F", mb, 0))
            first = Work("leader", mb, "F")
            stage_of[first] = 0
            leader.submit(first)
        for rank, core in enumerate(cores):
            chosen = core.grant()
            if chosen is not None:
                stage = stage_of.pop(chosen)
                end = now + costs.of(chosen.phase, stage)
                running[rank] = (chosen, stage, end)
                order[rank].append((chosen.phase, chosen.microbatch, chosen.visit))
                ends[rank] = end
        times = [r[2] for r in running if r is not None] + [p[0] for p in pending[:1]]
        if not times:
            break
        now = max(now, min(times))
    if leader.finished_count < microbatches or any(core.waiting for core in cores):
        raise ScheduleError(f"the {policy.pipeline} policy stalls: no rank can go on")
    return order, max(ends, default=0.0)

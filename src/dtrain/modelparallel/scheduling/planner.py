"""Plans: the runtime model (:mod:`.runtime_model`, every rank's scheduling core driven as the
runtime drives it) run over the pipeline's times, so that a plan is the order the runtime's
rules give; and the zero-bubble choice of which backwards to split."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from dtrain.modelparallel.scheduling.costs import (
    Costs,
    check_partitions,
    check_positive_int,
)
from dtrain.modelparallel.scheduling.policy import SchedulePolicy, check_pipeline
from dtrain.modelparallel.scheduling.runtime_model import RuntimeModel, Visit
from dtrain.modelparallel.scheduling.schedule import Schedule, with_messages

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
    best_time = _run(best, stages, costs, route)[1]
    for stage in range(stages - 1, 0, -1):
        if ranks[stage] == 0 or ranks[stage] in whole_partitions:
            continue
        for count in range(1, min(policy.microbatches, 2 * stage + 2) + 1):
            split = [*best.split, *[0] * (stages - len(best.split))]
            split[stage] = count
            candidate = replace(best, split=tuple(split))
            makespan = _run(candidate, stages, costs, route)[1]
            if makespan < best_time * (1 - 1e-9):
                best, best_time = candidate, makespan
    return best


def schedule_of(policy: SchedulePolicy, stages: int, costs: Costs) -> Schedule:
    """The action lists ``policy`` runs on ``stages`` ranks when the work costs ``costs``."""
    order, _ = _run(policy, stages, costs)
    actions = tuple(
        tuple(
            action
            for kind, mb, _ in rank_order
            for action in with_messages(kind, mb, stage, stages)
        )
        for stage, rank_order in enumerate(order)
    )
    return Schedule(policy.pipeline, stages, policy.microbatches, policy.active, actions)


def route_orders(policy: SchedulePolicy, route: tuple[int, ...], costs: Costs) -> list[list[Visit]]:
    """Each rank's compute actions, in order, for a microbatch whose stages run on the ranks
    of ``route`` (stage ``s`` on rank ``route[s]``; ``costs`` per stage): the plan order of a
    model whose forward comes back to the leader after the other partitions, ``(0, 1, 0)``
    for a head tied to the embedding. One core per rank schedules all of that rank's stages,
    as the runtime's one token does; a rank's visits are its stages in forward order."""
    check_route(route)
    return _run(policy, len(route), costs, route)[0]


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


def _run(
    policy: SchedulePolicy, stages: int, costs: Costs, route: tuple[int, ...] | None = None
) -> tuple[list[list[Visit]], float]:
    """Each rank's compute actions in the order the runtime model runs them under ``policy``
    on ``stages`` stages (on the ranks of ``route``, default a chain), and when the last one
    ends."""
    if len(costs.forward) != stages or len(costs.backward) != stages:
        raise ValueError(f"costs: got {len(costs.forward)} stages; need one per stage ({stages})")
    model = RuntimeModel(policy, costs, route or ())
    order = model.run()
    return order, model.makespan

"""The plan of a model whose microbatch comes back to the leader (a head tied to the
embedding): its *route*, the partitions a microbatch's forward goes through in order, and each
rank's compute actions per visit (:func:`~.planner.route_orders`), printable as a
:class:`RouteSchedule`.

The chain plans of :mod:`.schedule` (stage ``s`` on rank ``s``) cannot say that partition 0
computes a microbatch's forward twice; a route plan's actions name the stage of the route they
belong to, and the runtime's plan order (:mod:`.order`) keys them ``(kind, microbatch,
visit)``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.scheduling.costs import Costs, check_partitions
from dtrain.modelparallel.scheduling.order import Key
from dtrain.modelparallel.scheduling.planner import (
    SPLIT_OVERHEAD,
    check_route,
    route_orders,
    schedule_of,
    zero_bubble_policy,
)
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.schedule import Schedule

ORDER_ADVICE = (
    "Register the modules in the order the forward calls them (a head registered before the "
    "layers it runs after breaks the plan); place a module whose own code runs around its "
    "submodules (a container's forward) on one partition with all of them "
    "(smp.set_partition(module, k) places its submodules too), and the modules called after "
    "it on the same or later partitions, or back on partition 0 to end. The automatic "
    "partition (auto_partition) keeps such placements as constraints: pin that module there "
    "too. Or (without tensor parallelism) set deterministic_server to false"
)
"""What to do where the plan order cannot serve a model's placement (see
:func:`.planner.check_route`): a plan made without running the model follows the order the
modules are registered in, and the code of a module on one partition runs again after its
submodules on another return."""


def route_of(modules: Iterable[tuple[int, float]]) -> tuple[tuple[int, ...], list[float]]:
    """The route of a forward whose modules run in order on the partitions of ``modules``
    (``(owner, seconds)`` each), and each stage's seconds: a stage per run of consecutive
    modules on one partition (owners ``0 0 1 1 0`` make the route ``(0, 1, 0)``)."""
    route: list[int] = []
    times: list[float] = []
    for owner, seconds in modules:
        if not route or route[-1] != owner:
            route.append(owner)
            times.append(0.0)
        times[-1] += seconds
    return (tuple(route), times) if route else ((0,), [0.0])


def is_chain(route: tuple[int, ...]) -> bool:
    """Whether the route is a chain ``0, 1, ..., k``, which the chain plans serve."""
    return route == tuple(range(len(route)))


@dataclass(frozen=True)
class RouteSchedule:
    """Each rank's compute actions, in the order a step runs them, for a microbatch that goes
    through the partitions of ``route`` (stage ``s`` on rank ``route[s]``)."""

    route: tuple[int, ...]
    policy: SchedulePolicy
    rows: tuple[tuple[Key, ...], ...]
    """``rows[r]``: rank ``r``'s ``(kind, microbatch, visit)`` actions, in order."""

    @property
    def pipeline(self) -> str:
        return self.policy.pipeline

    def plan_row(self, rank: int) -> tuple[Key, ...]:
        """Rank ``rank``'s compute actions as plan-order keys (what the runtime follows)."""
        return self.rows[rank]

    def stage_of(self, rank: int, visit: int) -> int:
        """The stage of the route that is ``rank``'s ``visit``-th."""
        return [s for s, owner in enumerate(self.route) if owner == rank][visit]

    def __str__(self) -> str:
        """One row per rank, its actions in plan order (not aligned in time); an action of a
        visit after the first is prefixed with its stage, ``2:F0``."""
        route = " -> ".join(map(str, self.route))
        header = (
            f"{self.pipeline} pipeline over the route {route}: {len(self.rows)} ranks, "
            f"{self.policy.microbatches} microbatches, at most {self.policy.active} in flight "
            "(actions in plan order)"
        )
        label = f"rank {{:>{len(str(len(self.rows) - 1))}}}"
        lines = [header]
        for rank, row in enumerate(self.rows):
            shown = [
                f"{self.stage_of(rank, visit)}:{kind}{mb}" if visit else f"{kind}{mb}"
                for kind, mb, visit in row
            ]
            lines.append(f"{label.format(rank)} | " + " ".join(shown))
        return "\n".join(lines)


def pipeline_plan(
    policy: SchedulePolicy,
    stage_times: list[float],
    modules: list[tuple[int, float]],
    ordered: bool,
    whole_partitions: Collection[int] = (),
) -> Schedule | RouteSchedule:
    """The plan of a step: each partition's actions for ``policy``, with the backwards that
    shorten it most split (none of ``whole_partitions``, which run their backwards whole),
    from each partition's ``stage_times`` (zeros: unknown) and the model's ``modules`` as
    ``(owner, seconds)`` in forward order.

    Where the runtime follows the plan (``ordered``: ``deterministic_server``, tensor
    parallelism) and the modules' order takes a microbatch back to partition 0 (a head tied to
    the embedding), the plan is per visit (:func:`~.planner.route_orders`); a route no plan
    serves fails naming it. Otherwise it is a chain plan, the runtime's order when work runs as
    it becomes ready only where the forward is a chain.
    """
    check_partitions("whole_partitions", whole_partitions, len(stage_times))
    route, route_times = route_of(modules)  # the order the caller knows: profiled, or registered
    if not ordered or is_chain(route):
        costs = Costs.of_stages(stage_times, SPLIT_OVERHEAD)
        policy = zero_bubble_policy(
            policy, len(stage_times), costs, whole_partitions=whole_partitions
        )
        return schedule_of(policy, len(stage_times), costs)
    try:
        check_route(route)
    except ValueError as error:
        raise ModelParallelError(
            "deterministic_server (or tensor parallelism) runs each rank's plan, made for "
            "the model's modules in the order they run (as profiled, or as registered where "
            "the model was not run to plan), on the partitions "
            f"{' -> '.join(map(str, route))}: {error}. {ORDER_ADVICE}"
        ) from None
    costs = Costs.of_stages(route_times, SPLIT_OVERHEAD)
    policy = zero_bubble_policy(policy, len(route), costs, route, whole_partitions)
    rows = route_orders(policy, route, costs)
    return RouteSchedule(route, policy, tuple(tuple(row) for row in rows))

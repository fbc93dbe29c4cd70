"""The route of a model's forward and the plan made for it (:mod:`.scheduling.route`), as
tables, without processes."""

from __future__ import annotations

import pytest

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.planner import (
    SPLIT_OVERHEAD,
    route_orders,
    schedule_of,
    zero_bubble_policy,
)
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.route import (
    ORDER_ADVICE,
    RouteSchedule,
    pipeline_plan,
    route_of,
)
from dtrain.modelparallel.scheduling.schedule import Schedule

POLICY = SchedulePolicy.for_config("interleaved", 4, 4)
TIED = [(0, 1.0), (0, 2.0), (1, 3.0), (1, 1.0), (0, 0.5)]
"""Modules in forward order, ``(owner, seconds)``: embedding and blocks, blocks, tied head."""


@pytest.mark.parametrize(
    ("owners", "route"),
    [
        ([0, 0, 1, 1, 0], (0, 1, 0)),
        ([0, 1, 2], (0, 1, 2)),
        ([0, 0], (0,)),
        ([], (0,)),
        ([0, 1, 0, 1, 0], (0, 1, 0, 1, 0)),
    ],
)
def test_the_route_is_a_stage_per_run_of_modules_on_one_partition(
    owners: list[int], route: tuple[int, ...]
) -> None:
    assert route_of((owner, 1.0) for owner in owners)[0] == route


def test_a_stage_costs_the_time_of_its_modules() -> None:
    assert route_of(TIED) == ((0, 1, 0), [3.0, 4.0, 0.5])


def test_an_ordered_tied_head_is_planned_per_visit() -> None:
    plan = pipeline_plan(POLICY, [3.5, 4.0], TIED, ordered=True)
    assert isinstance(plan, RouteSchedule) and plan.route == (0, 1, 0)
    costs = Costs.of_stages([3.0, 4.0, 0.5], SPLIT_OVERHEAD)
    policy = zero_bubble_policy(POLICY, 3, costs, (0, 1, 0))
    assert plan.policy == policy
    assert [list(row) for row in plan.rows] == route_orders(policy, (0, 1, 0), costs)
    assert ("F", 0, 1) in plan.plan_row(0) and ("B", 0, 1) in plan.plan_row(0)
    assert all(visit == 0 for _, _, visit in plan.plan_row(1))


def test_a_recomputing_partition_of_a_route_runs_whole_backwards_the_others_split() -> None:
    """Route 0 -> 1 -> 2 -> 0 with partition 1 recomputing: the ordered plan splits only
    partition 2's backwards, and its print shows partition 1's whole ones."""
    modules = [(0, 1.0), (1, 1.0), (2, 1.0), (0, 0.5)]
    plan = pipeline_plan(POLICY, [1.5, 1.0, 1.0], modules, True, whole_partitions={1})
    assert isinstance(plan, RouteSchedule) and plan.policy.split == (0, 0, 4, 0)
    lines = str(plan).splitlines()
    assert lines[2:] == [
        "rank 1 | F0 F1 F2 B0 B1 B2 F3 B3",
        "rank 2 | F0 F1 F2 I0 I1 W0 I2 W1 W2 F3 I3 W3",
    ]


def test_a_route_plan_prints_each_ranks_actions_with_the_stage_of_a_later_visit() -> None:
    plan = RouteSchedule(
        (0, 1, 0), POLICY, ((("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)), (("F", 0, 0),))
    )
    lines = str(plan).splitlines()
    assert "route 0 -> 1 -> 0" in lines[0]
    assert lines[1:] == ["rank 0 | F0 2:F0 2:B0 B0", "rank 1 | F0"]


@pytest.mark.parametrize("ordered", [True, False])
def test_a_chain_gets_the_chain_plan(ordered: bool) -> None:
    modules = [(0, 1.0), (1, 1.0)]
    plan = pipeline_plan(POLICY, [1.0, 2.0], modules, ordered=ordered)
    costs = Costs.of_stages([1.0, 2.0], SPLIT_OVERHEAD)
    assert plan == schedule_of(zero_bubble_policy(POLICY, 2, costs), 2, costs)
    assert isinstance(plan, Schedule)
    assert plan.plan_row(1)[0] == ("F", 0, 0)


def test_without_a_plan_order_a_tied_head_keeps_the_chain_plan() -> None:
    """Work runs as it becomes ready: the chain plan, a prediction of that order."""
    plan = pipeline_plan(POLICY, [3.5, 4.0], TIED, ordered=False)
    assert isinstance(plan, Schedule) and plan.stages == 2


def test_a_route_no_plan_serves_fails_naming_it() -> None:
    modules = [(0, 1.0), (1, 1.0), (0, 1.0), (1, 1.0)]
    with pytest.raises(ModelParallelError, match=r"partitions 0 -> 1 -> 0 -> 1: route: got") as e:
        pipeline_plan(POLICY, [1.0, 1.0], modules, ordered=True)
    assert str(e.value).endswith(ORDER_ADVICE)  # says what to do, with auto_partition too
    for advice in ("Register the modules in the order", "smp.set_partition", "auto_partition"):
        assert advice in ORDER_ADVICE

"""The runtime model (:mod:`dtrain.modelparallel.scheduling.runtime_model`): the one event model
the planner runs, driven here with each rank's plan row as the runtime follows it
(``deterministic_server``), without threads or processes."""

from __future__ import annotations

import random
import re

import pytest

from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.ordering import PlannedOrdering, Tell
from dtrain.modelparallel.scheduling.planner import route_orders, schedule_of, zero_bubble_policy
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.runtime_model import RuntimeDeadlock, RuntimeModel, Visit
from dtrain.modelparallel.scheduling.scheduler import Work

Order = list[list[Visit]]


def random_costs(rng: random.Random, stages: int) -> Costs:
    """Uneven stages, backwards dearer than forwards on average, some message latency."""
    return Costs.per_stage(
        stages,
        [rng.uniform(0.2, 2.0) for _ in range(stages)],
        [rng.uniform(0.3, 4.0) for _ in range(stages)],
        rng.choice([0.0, 0.1, 0.5]),
        0.2,
    )


def _planned(policy: SchedulePolicy, stages: int, costs: Costs) -> Order:
    plan = schedule_of(policy, stages, costs)
    return [[(*row,) for row in plan.plan_row(s)] for s in range(stages)]


def _following(rows: Order, ordering: type[PlannedOrdering] = PlannedOrdering) -> list:
    return [ordering(tuple(row), rank) for rank, row in enumerate(rows)]


def test_a_finished_microbatchs_slot_is_refilled_before_the_token_goes_on() -> None:
    """Regression: the leader's task handed the token on as it ended, before the main thread
    admitted the next microbatch, so the next backward (terminal) ran before the forward,
    which would have fed the other stages."""
    costs = Costs.per_stage(1, 1.9, 0.4, 0.1)
    ran = RuntimeModel(SchedulePolicy("interleaved", 8, 4), costs).run()
    assert [f"{k}{m}" for k, m, _ in ran[0]][:8] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5"]


def _ran_in_plan_order(stages: int, microbatches: int, active: int, costs: Costs, **kw) -> bool:
    policy = zero_bubble_policy(SchedulePolicy("interleaved", microbatches, active), stages, costs)
    rows = _planned(policy, stages, costs)
    ordering = kw.pop("ordering", PlannedOrdering)
    return RuntimeModel(policy, costs, orderings=_following(rows, ordering), **kw).run() == rows


class _ForwardsEndOnlyWhenWhole(PlannedOrdering):
    """The runtime before a partition learned that the leader's forward had moved on from it:
    its forward of a microbatch ended only once the whole forward had."""

    def moved_on(self, tell: Tell, work: Work, partition: int) -> None:
        pass


# deterministic_server on 4 stages, the loss computed on the leader from the last stage's
# outputs (fetched): each rank's forward of a microbatch ends when...
DEADLOCK_COSTS = Costs.per_stage(4, [1.35, 0.96, 1.14, 1.42], [3.58, 3.38, 3.99, 2.65], 0.0, 0.2)
DEADLOCK = [
    # ...the whole forward has ended (the runtime before): rank 1 waits in F2's turn for the
    # last stage's F2, which waits in B1's turn for the leader's B1, which waits in B0's turn
    # for rank 1's B0, after F2 in rank 1's order.
    (
        _ForwardsEndOnlyWhenWhole,
        "{0: 'B0 of step 1', 1: 'F2 of step 1', 2: 'F2 of step 1', 3: 'B1 of step 1'}",
    ),
    # ...the leader's forward has moved on to the next rank (and its work here has run).
    (PlannedOrdering, None),
]


@pytest.mark.parametrize(("ordering", "stuck"), DEADLOCK)
def test_a_fixed_order_on_four_stages_deadlocked_until_forwards_ended_as_they_moved_on(
    ordering: type[PlannedOrdering], stuck: str | None
) -> None:
    if stuck is None:
        assert _ran_in_plan_order(4, 3, 3, DEADLOCK_COSTS, ordering=ordering, fetched_loss=True)
        return
    with pytest.raises(RuntimeDeadlock, match=re.escape(stuck)):
        _ran_in_plan_order(4, 3, 3, DEADLOCK_COSTS, ordering=ordering, fetched_loss=True)


def test_with_a_plan_order_every_rank_follows_its_row_for_any_number_of_stages() -> None:
    """``deterministic_server``: random costs, 1 to 4 stages, the loss deferred to the last
    stage or fetched by the leader; ties do not matter (the plan decides)."""
    rng = random.Random(28)
    for _ in range(60):
        stages, microbatches = rng.randint(1, 4), rng.randint(1, 8)
        costs = random_costs(rng, stages)
        active = rng.randint(1, microbatches)
        assert _ran_in_plan_order(
            stages, microbatches, active, costs, fetched_loss=rng.random() < 0.5
        )


def test_with_a_plan_order_a_microbatch_that_comes_back_to_the_leader_follows_the_rows() -> None:
    """A head tied to the embedding (routes ``0 -> 1 -> 0`` and longer): the leader's task
    follows a turn per visit (the ordering's own visit rules, as the runtime asks them) and
    every rank its row."""
    rng = random.Random(5)
    for _ in range(60):
        route = (*range(rng.randint(2, 4)), 0)
        microbatches = rng.randint(1, 6)
        costs = random_costs(rng, len(route))
        policy = SchedulePolicy.for_config(
            rng.choice(["simple", "interleaved"]), microbatches, rng.randint(1, microbatches)
        )
        policy = zero_bubble_policy(policy, len(route), costs, route)
        rows = route_orders(policy, route, costs)
        assert RuntimeModel(policy, costs, route, _following(rows)).run() == rows, route

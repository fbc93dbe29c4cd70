"""The plan is the runtime's order: random costs through the planner and through the scheduling
core driven as the executor drives it (:mod:`tests.modelparallel.runtime_model`), without
threads or processes."""

from __future__ import annotations

import random
import re

import pytest

from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.planner import schedule_of, zero_bubble_policy
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from tests.modelparallel.runtime_model import RuntimeDeadlock, RuntimeModel, random_costs

Order = list[list[tuple[str, int]]]


def _planned(policy: SchedulePolicy, stages: int, costs: Costs) -> Order:
    plan = schedule_of(policy, stages, costs)
    return [[(a.kind, a.microbatch) for a in plan.compute_actions(s)] for s in range(stages)]


def test_random_costs_give_the_plans_order_on_every_rank() -> None:
    """Whenever no two things reach a rank at the same instant, every rank computes in its
    plan row's order. At such a tie (``tied``) the runtime's order depends on which thread gets
    there first, and the plan's on the order it looks at them, so those cases are not
    compared; they are few."""
    rng = random.Random(23)
    compared = 0
    for _ in range(120):
        stages, microbatches = rng.randint(1, 4), rng.randint(1, 8)
        costs = random_costs(rng, stages)
        pipeline = rng.choice(["simple", "interleaved"])
        policy = SchedulePolicy.for_config(pipeline, microbatches, rng.randint(1, microbatches))
        policy = zero_bubble_policy(policy, stages, costs)
        model = RuntimeModel(policy, stages, costs)
        ran = model.run()
        if not model.tied:
            compared += 1
            assert ran == _planned(policy, stages, costs), (policy, stages, costs)
    assert compared >= 90


def test_a_finished_microbatchs_slot_is_refilled_before_the_token_goes_on() -> None:
    """Regression: the leader's task handed the token on as it ended, before the main thread
    admitted the next microbatch, so the next backward (terminal) ran before the forward the
    plan puts there, which would have fed the other stages."""
    costs = Costs.per_stage(1, 1.9, 0.4, 0.1)
    policy = SchedulePolicy("interleaved", 8, 4)
    ran = RuntimeModel(policy, 1, costs).run()
    assert ran == _planned(policy, 1, costs)
    assert [f"{k}{m}" for k, m in ran[0]][:8] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5"]


def _ran_in_plan_order(stages: int, microbatches: int, active: int, costs: Costs, **kw) -> bool:
    policy = zero_bubble_policy(SchedulePolicy("interleaved", microbatches, active), stages, costs)
    plan = schedule_of(policy, stages, costs)
    return RuntimeModel(policy, stages, costs, plan, **kw).run() == _planned(policy, stages, costs)


# deterministic_server on 4 stages, the loss computed on the leader from the last stage's
# outputs (fetched): each rank's forward of a microbatch ends when...
DEADLOCK_COSTS = Costs.per_stage(4, [1.35, 0.96, 1.14, 1.42], [3.58, 3.38, 3.99, 2.65], 0.0, 0.2)
DEADLOCK = [
    # ...the whole forward has ended (the runtime before): rank 1 waits in F2's turn for the
    # last stage's F2, which waits in B1's turn for the leader's B1, which waits in B0's turn
    # for rank 1's B0, after F2 in rank 1's order.
    (False, "{0: 'B0', 1: 'F2', 2: 'F2', 3: 'B1'}"),
    # ...the leader's forward has moved on to the next rank (and its work here has run).
    (True, None),
]


@pytest.mark.parametrize(("moved_on", "stuck"), DEADLOCK)
def test_a_fixed_order_on_four_stages_deadlocked_until_forwards_ended_as_they_moved_on(
    moved_on: bool, stuck: str | None
) -> None:
    if stuck is None:
        assert _ran_in_plan_order(4, 3, 3, DEADLOCK_COSTS, moved_on=moved_on, fetched_loss=True)
        return
    with pytest.raises(RuntimeDeadlock, match=re.escape(stuck)):
        _ran_in_plan_order(4, 3, 3, DEADLOCK_COSTS, moved_on=moved_on, fetched_loss=True)


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

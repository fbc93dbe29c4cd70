"""The plan is the runtime's order: random costs through the planner and through the scheduling
core driven as the executor drives it (:mod:`tests.modelparallel.runtime_model`), without
threads or processes."""

from __future__ import annotations

import random

from dtrain.modelparallel.policy import SchedulePolicy
from dtrain.modelparallel.schedule import Costs, schedule_of, zero_bubble_policy
from tests.modelparallel.runtime_model import RuntimeModel, random_costs

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

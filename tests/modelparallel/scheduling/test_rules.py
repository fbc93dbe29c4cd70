"""The chain's rules as tables: what each action needs, its messages, which work is a backward,
and the two counts of microbatches a rank keeps (in flight, held)."""

from __future__ import annotations

import random

import pytest

from dtrain.modelparallel.scheduling.check import check
from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.order import PlanOrder
from dtrain.modelparallel.scheduling.planner import build_schedule
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.rules import (
    Flight,
    backward_phases,
    is_gradient,
    needs,
    ordering_pairs,
    plan_phase,
    ready_at,
    receives,
    sends,
)
from dtrain.modelparallel.scheduling.schedule import simulate
from tests.modelparallel.scheduling.test_runtime_model import random_costs

# kind, stage (of 3) -> what it needs, as "kind@offset".
NEEDS = [
    ("F", 0, []),  # the first stage's forward needs nothing: the leader admits it
    ("F", 1, ["F@-1"]),
    ("B", 1, ["F@0", "G@1"]),
    ("I", 1, ["F@0", "G@1"]),  # an input half needs what a whole backward needs
    ("B", 2, ["F@0"]),  # the last stage has no next one to wait for
    ("W", 2, ["I@0"]),
    ("SEND_F", 0, ["F@0"]),
    ("SEND_B", 1, ["G@0"]),
    ("RECV_F", 1, []),  # a receive waits for its send's message, not a compute
]


@pytest.mark.parametrize(("kind", "stage", "expected"), NEEDS)
def test_what_each_action_needs(kind: str, stage: int, expected: list[str]) -> None:
    assert [f"{n.kind}@{n.offset}" for n in needs(kind, stage, 3)] == expected


# kind, stage (of 3) -> the messages around it.
MESSAGES = [
    ("F", 0, [], ["SEND_F"]),
    ("F", 1, ["RECV_F"], ["SEND_F"]),
    ("F", 2, ["RECV_F"], []),
    ("B", 0, ["RECV_B"], []),
    ("I", 1, ["RECV_B"], ["SEND_B"]),
    ("B", 2, [], ["SEND_B"]),
    ("W", 1, [], []),  # nobody waits for a weight half but the optimizer step
]


@pytest.mark.parametrize(("kind", "stage", "before", "after"), MESSAGES)
def test_the_messages_around_each_compute_action(
    kind: str, stage: int, before: list[str], after: list[str]
) -> None:
    assert receives(kind, stage, 3) == before
    assert sends(kind, stage, 3) == after


def test_the_checker_orders_what_the_table_needs() -> None:
    assert set(ordering_pairs()) == {
        ("RECV_F", "F"),
        ("F", "SEND_F"),
        ("F", "B"),
        ("RECV_B", "B"),
        ("B", "SEND_B"),
        ("F", "I"),
        ("RECV_B", "I"),
        ("I", "SEND_B"),
        ("I", "W"),
    }


# ended (phase, mb, stage -> time), kind, stage -> ready time (latency 0.5), first unmet need.
READY = [
    ({}, "F", 0, 0.0, None),
    ({("F", 0, 0): 1.0}, "F", 1, 1.5, None),  # a message's latency after the forward
    ({("F", 0, 1): 2.0}, "B", 1, None, "B0 on rank 2"),
    ({("F", 0, 1): 2.0, ("I", 0, 2): 3.0}, "B", 1, 3.5, None),  # I counts as B
    ({("F", 0, 1): 4.0, ("B", 0, 2): 3.0}, "I", 1, 4.0, None),
    ({}, "W", 2, None, "its own I0"),
]


@pytest.mark.parametrize(("ended", "kind", "stage", "ready", "missing"), READY)
def test_an_action_is_ready_once_every_need_has_ended(
    ended: dict[tuple[str, int, int], float],
    kind: str,
    stage: int,
    ready: float | None,
    missing: str | None,
) -> None:
    got, need = ready_at(kind, 0, stage, 3, lambda *key: ended.get(key), latency=0.5)
    assert got == ready
    assert (None if need is None else need.describe(0, stage)) == missing


# "I counts as B": one definition, asked by the priority, the plan order and the checker.
@pytest.mark.parametrize(
    ("phase", "gradient", "planned"),
    [("F", False, "F"), ("B", True, "B"), ("I", True, "B"), ("W", False, "W")],
)
def test_an_input_half_is_its_microbatchs_backward(
    phase: str, gradient: bool, planned: str
) -> None:
    assert is_gradient(phase) is gradient
    assert plan_phase(phase) == planned
    policy = SchedulePolicy("interleaved", 2, 2)
    assert (policy.priority(phase, 1) == policy.priority("B", 1)) is gradient  # type: ignore[arg-type]
    assert PlanOrder.of([("B", 1)]).admits(phase, 1) is gradient
    assert backward_phases(split=phase == "I")[0] == ("I" if phase == "I" else "B")


# A rank's actions -> (most in flight, most held).
FLIGHT = [
    ("F0 F1 B0 B1", 2, 2),
    ("F0 I0 F1 I1 W0 W1", 1, 2),  # owed weight halves keep activations, not flight
    ("F0 F1 I0 F2 W0 B1 B2", 2, 3),  # a weight half owed while another forward comes in
    ("F0 B0 F1 B1", 1, 1),
]


@pytest.mark.parametrize(("actions", "in_flight", "held"), FLIGHT)
def test_in_flight_ends_with_the_gradients_held_with_the_last_half(
    actions: str, in_flight: int, held: int
) -> None:
    flight = Flight.of((word[0], int(word[1:])) for word in actions.split())
    assert (flight.peak, flight.peak_held) == (in_flight, held)


def test_a_plan_whose_weight_halves_wait_past_admission_passes_the_check() -> None:
    """Regression: the checker counted a microbatch in flight until its weight half, so it
    refused the planner's own plan, where the last stage's weight halves wait for the drain
    while the leader admits within its bound (admission counts until the gradients)."""
    costs = Costs.per_stage(4, [1.41, 1.13, 1.07, 1.36], [3.62, 0.85, 0.65, 3.07], 0.5, 0.2)
    plan = build_schedule("interleaved", 4, 6, 5, costs=costs)
    timed = simulate(plan, costs)
    assert max(timed.peak_in_flight) <= 5 < max(timed.peak_held)
    check(plan)


def test_every_ranks_flight_lies_inside_the_leaders() -> None:
    """Why the checker's count (per rank, forward to gradients) never exceeds the leader's
    admission count: on every rank a microbatch starts its forward after the first stage's and
    computes its gradients before the first stage's backward."""
    rng = random.Random(7)
    for _ in range(40):
        stages, microbatches = rng.randint(2, 4), rng.randint(2, 7)
        costs = random_costs(rng, stages)
        active = rng.randint(1, microbatches)
        timed = simulate(
            build_schedule("interleaved", stages, microbatches, active, costs=costs), costs
        )
        starts = {
            (e.rank, e.kind if not is_gradient(e.kind) else "G", e.microbatch): e.start
            for rank_events in timed.events
            for e in rank_events
        }
        for rank in range(1, stages):
            for mb in range(microbatches):
                assert starts[(0, "F", mb)] <= starts[(rank, "F", mb)]
                assert starts[(rank, "G", mb)] <= starts[(0, "G", mb)]
        assert max(timed.peak_in_flight) <= active

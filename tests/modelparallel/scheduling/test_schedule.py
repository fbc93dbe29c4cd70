"""Pipeline schedules as data: exact lists, rules, memory bound, simulator, deadlocks, export.

No model and no processes: schedules are checked and timed by the simulator alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.modelparallel.scheduling.check import check
from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.planner import (
    build_schedule,
    route_orders,
    schedule_of,
    zero_bubble_policy,
)
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.route import pipeline_plan
from dtrain.modelparallel.scheduling.schedule import (
    Action,
    Schedule,
    ScheduleDeadlock,
    ScheduleError,
    recorded_schedule,
    simulate,
    timeline,
)
from dtrain.modelparallel.timeline import TimelineEvent, write_chrome_trace


def rank(stage: int, text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(word, stage) for word in text.split())


def schedule(pipeline: str, microbatches: int, active: int, *rows: str) -> Schedule:
    """A hand-built schedule, one string of actions per rank."""
    actions = tuple(rank(stage, row) for stage, row in enumerate(rows))
    return Schedule(pipeline, len(rows), microbatches, active, actions)


GRID = [
    (pipeline, stages, microbatches, active)
    for pipeline in ("simple", "interleaved")
    for stages in range(1, 5)
    for microbatches in range(1, 9)
    for active in range(1, microbatches + 1)
]


# Exact action lists (P=2, M=4), written out by hand: what the policy runs with forward 1,
# backward 2, each half of a split backward 1.2.


def test_simple_two_stages_four_microbatches() -> None:
    built = build_schedule("simple", 2, 4)
    assert built.pipeline == "simple"
    assert built.active_microbatches == 4
    assert built.actions == (
        rank(
            0,
            "F0 SEND_F0 F1 SEND_F1 F2 SEND_F2 F3 SEND_F3 "
            "RECV_B0 B0 RECV_B1 B1 RECV_B2 B2 RECV_B3 B3",
        ),
        rank(  # every input half first, the weight halves while rank 0 does its backwards
            1,
            "RECV_F0 F0 RECV_F1 F1 RECV_F2 F2 RECV_F3 F3 "
            "I0 SEND_B0 I1 SEND_B1 I2 SEND_B2 I3 SEND_B3 W0 W1 W2 W3",
        ),
    )


def test_interleaved_two_stages_four_microbatches() -> None:
    built = build_schedule("interleaved", 2, 4)
    assert built.active_microbatches == 4  # default stages + 2, clamped to microbatches
    assert built.actions == (
        rank(  # the leader admits up to 4: forwards until the first gradient is back
            0,
            "F0 SEND_F0 F1 SEND_F1 F2 SEND_F2 F3 SEND_F3 "
            "RECV_B0 B0 RECV_B1 B1 RECV_B2 B2 RECV_B3 B3",
        ),
        rank(
            1,
            "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 "
            "RECV_F2 F2 I2 SEND_B2 RECV_F3 F3 I3 SEND_B3 W2 W3",
        ),
    )
    assert built.policy == SchedulePolicy("interleaved", 4, 4, split=(0, 2))


def test_interleaved_one_active_alternates_on_every_rank() -> None:
    built = build_schedule("interleaved", 2, 4, active_microbatches=1, split_backward=False)
    for stage in range(2):
        assert " ".join(map(str, built.compute_actions(stage))) == "F0 B0 F1 B1 F2 B2 F3 B3"


def test_one_stage_has_no_communication() -> None:
    # The leader's backwards are terminal (nobody waits for them): forwards go first.
    assert build_schedule("interleaved", 1, 3).actions == (rank(0, "F0 F1 F2 B0 B1 B2"),)
    assert build_schedule("simple", 1, 3, 3).actions == (rank(0, "F0 F1 F2 B0 B1 B2"),)


def test_fewer_microbatches_than_stages() -> None:
    built = build_schedule("interleaved", 4, 2, split_backward=False)
    assert [len(built.compute_actions(s)) for s in range(4)] == [4, 4, 4, 4]
    assert [str(a) for a in built.compute_actions(0)] == ["F0", "F1", "B0", "B1"]
    assert [str(a) for a in built.compute_actions(3)] == ["F0", "B0", "F1", "B1"]


# Rules, over a grid of shapes.


@pytest.mark.parametrize(("pipeline", "stages", "microbatches", "active"), GRID)
def test_built_schedules_pass_check(
    pipeline: str, stages: int, microbatches: int, active: int
) -> None:
    check(build_schedule(pipeline, stages, microbatches, active))


@pytest.mark.parametrize(("pipeline", "stages", "microbatches", "active"), GRID)
def test_in_flight_bound(pipeline: str, stages: int, microbatches: int, active: int) -> None:
    built = build_schedule(pipeline, stages, microbatches, active)
    peaks = simulate(built).peak_in_flight
    if built.pipeline == "simple":
        assert peaks == (microbatches,) * stages
    else:
        # The leader admits while fewer than active_microbatches are unfinished, and its
        # backwards (terminal) yield to the forwards it admitted: it fills every slot.
        assert max(peaks) <= active
        assert peaks[0] == min(active, microbatches)


def test_simple_keeps_every_microbatch_in_flight() -> None:
    assert simulate(build_schedule("simple", 3, 5, 5)).peak_in_flight == (5, 5, 5)


# SMP's rule: simple is forced to interleaved when active < microbatches.


def test_simple_forced_to_interleaved_when_active_below_microbatches() -> None:
    forced = build_schedule("simple", 2, 8, active_microbatches=3)
    assert forced.pipeline == "interleaved"
    assert forced == build_schedule("interleaved", 2, 8, active_microbatches=3)


def test_simple_forced_by_the_default_active() -> None:
    # Default active = stages + 2 = 4 < 8 microbatches.
    assert build_schedule("simple", 2, 8).pipeline == "interleaved"
    assert build_schedule("simple", 2, 4).pipeline == "simple"


def test_active_is_clamped_to_microbatches() -> None:
    built = build_schedule("simple", 2, 3, active_microbatches=10)
    assert built.pipeline == "simple"
    assert built.active_microbatches == 3


def test_simple_schedule_with_active_below_microbatches_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"simple.*interleaved"):
        Schedule("simple", 1, 2, 1, (rank(0, "F0 F1 B0 B1"),))


# Simulated makespan.


def bubble_formula(stage_costs: list[float], microbatches: int) -> float:
    """``max(stage_costs) x (M + P - 1)``, ``stage_costs[s]`` a stage's forward + backward:
    the exact makespan of uniform stages without latency, an upper bound for uneven ones."""
    return max(stage_costs) * (microbatches + len(stage_costs) - 1)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("forward", "backward"), [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
def test_uniform_makespan_matches_bubble_formula(
    stages: int, microbatches: int, forward: float, backward: float
) -> None:
    ideal = bubble_formula([forward + backward] * stages, microbatches)
    costs = Costs.per_stage(stages, forward, backward)
    for active in range(min(stages, microbatches), microbatches + 1):
        built = build_schedule(
            "interleaved", stages, microbatches, active, split_backward=False, costs=costs
        )
        makespan = simulate(built, costs).makespan
        if active == stages < microbatches and forward > backward:
            # Admission waits for a microbatch's last backward on the leader: a bound of
            # exactly one per stage then costs up to a forward more than the formula.
            assert ideal <= makespan <= ideal + forward
        else:
            assert makespan == pytest.approx(ideal)
    gpipe = build_schedule(
        "simple", stages, microbatches, microbatches, split_backward=False, costs=costs
    )
    assert simulate(gpipe, costs).makespan == pytest.approx(ideal)


def test_fewer_active_than_stages_costs_time() -> None:
    ideal = bubble_formula([3.0] * 4, 8)
    assert simulate(build_schedule("interleaved", 4, 8, 2)).makespan > ideal


def test_idle_share_is_the_bubble_formulas() -> None:
    result = simulate(build_schedule("interleaved", 4, 8, split_backward=False))
    # Idle share of rank-time: (P - 1) / (M + P - 1).
    idle = 1.0 - sum(result.busy) / (len(result.busy) * result.makespan)
    assert idle == pytest.approx(3 / 11)
    assert result.busy == (24.0,) * 4


def test_comm_latency_on_one_microbatch() -> None:
    costs = Costs.per_stage(3, comm_cost=0.5)
    result = simulate(build_schedule("interleaved", 3, 1, split_backward=False, costs=costs), costs)
    # Forward through 3 stages, backward through 3, 2 hops each way.
    assert result.makespan == pytest.approx(3 * 3.0 + 4 * 0.5)


def test_slowest_stage_sets_the_pace() -> None:
    costs = Costs.per_stage(3, [1.0, 2.0, 1.0], [2.0, 4.0, 2.0])
    result = simulate(build_schedule("interleaved", 3, 6, split_backward=False, costs=costs), costs)
    # At least the slowest stage's work; at most the formula (every stage as slow as it).
    assert 6 * 6.0 <= result.makespan <= bubble_formula([3.0, 6.0, 3.0], 6)
    assert result.makespan == pytest.approx(39.0)
    assert result.busy == (18.0, 36.0, 18.0)


def test_events_follow_the_action_lists() -> None:
    built = build_schedule("interleaved", 2, 4)
    result = simulate(built)
    for stage in range(2):
        assert [e.name for e in result.events[stage]] == [str(a) for a in built.actions[stage]]
        assert all(e.rank == stage for e in result.events[stage])
    f0_rank1 = next(e for e in result.events[1] if e.name == "F0")
    assert (f0_rank1.start, f0_rank1.end) == (1.0, 2.0)
    recv = result.events[1][0]
    assert (recv.kind, recv.start, recv.end) == ("RECV_F", 0.0, 1.0)  # waited for rank 0's F0


# Broken schedules.


def test_deadlock_names_each_blocked_rank_and_its_wait() -> None:
    # Rank 0 waits for a gradient before sending its activation; rank 1 waits for the activation.
    broken = schedule("interleaved", 1, 1, "F0 RECV_B0 SEND_F0 B0", "RECV_F0 F0 B0 SEND_B0")
    with pytest.raises(ScheduleDeadlock) as caught:
        simulate(broken)
    message = str(caught.value)
    assert "rank 0 is blocked at RECV_B0 waiting for SEND_B0 from rank 1" in message
    assert "rank 1 is blocked at RECV_F0 waiting for SEND_F0 from rank 0" in message
    assert set(caught.value.blocked) == {0, 1}
    with pytest.raises(ScheduleDeadlock):
        check(broken)


def test_deadlock_on_a_cycle_of_compute() -> None:
    # Rank 0 asks for microbatch 1's gradient before sending microbatch 1 forward.
    broken = schedule(
        "interleaved",
        2,
        2,
        "F0 SEND_F0 RECV_B1 B1 F1 SEND_F1 RECV_B0 B0",
        "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1",
    )
    with pytest.raises(ScheduleDeadlock, match="rank 0 is blocked at RECV_B1") as caught:
        simulate(broken)
    assert caught.value.blocked[1][0] == Action("RECV_F", 1, 1)


def test_str_of_a_deadlocked_schedule_lists_actions() -> None:
    broken = schedule("interleaved", 1, 1, "F0 RECV_B0 SEND_F0 B0", "RECV_F0 F0 B0 SEND_B0")
    text = str(broken)
    assert "deadlocks" in text
    assert "rank 0 | F0 RECV_B0 SEND_F0 B0" in text


@pytest.mark.parametrize(
    ("rows", "microbatches", "active", "expected"),
    [
        (("F0 SEND_F0 RECV_B0 B0", "RECV_F0 F0"), 1, 1, "rank 1: B0 missing"),
        (("F0 F0 B0",), 1, 1, "rank 0: F0 appears 2 times"),
        (("F0 RECV_B0 B0", "RECV_F0 F0 B0 SEND_B0"), 1, 1, "rank 0: SEND_F0 missing"),
        (("B0 F0",), 1, 1, "rank 0: F0 must come before B0"),
        (("RECV_F0 F0 B0",), 1, 1, "rank 0: unexpected RECV_F0 (stage 0 has no previous stage)"),
        (("F0 SEND_F0 B0",), 1, 1, "rank 0: unexpected SEND_F0 (the last stage has no next"),
        (("F0 F1 B0 B1",), 2, 1, "rank 0: 2 microbatches in flight, more than"),
        (("1:F0 B0", "RECV_F0 F0 B0 SEND_B0"), 1, 1, "rank 0: F0 belongs to stage 1"),
    ],
)
def test_check_reports_broken_rules(
    rows: tuple[str, ...], microbatches: int, active: int, expected: str
) -> None:
    with pytest.raises(ScheduleError, match="invalid schedule") as caught:
        check(schedule("interleaved", microbatches, active, *rows))
    assert expected in str(caught.value)


def test_check_simple_runs_every_forward_first() -> None:
    with pytest.raises(ScheduleError, match="simple pipeline runs a backward before"):
        check(schedule("simple", 2, 2, "F0 B0 F1 B1"))


# Validation.


@pytest.mark.parametrize("name", ["stages", "microbatches", "active_microbatches"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_non_positive_or_non_int_rejected(name: str, value: object) -> None:
    arguments: dict[str, object] = {"stages": 2, "microbatches": 4, "active_microbatches": 2}
    arguments[name] = value
    with pytest.raises(ValueError, match=f"^{name}: got {value!r}; must be a positive integer"):
        build_schedule("interleaved", **arguments)  # type: ignore[arg-type]


def test_unknown_pipeline_suggests_the_closest() -> None:
    with pytest.raises(ValueError, match=r"pipeline: got 'interleave'.*did you mean 'interleaved'"):
        build_schedule("interleave", 2, 4)
    with pytest.raises(ValueError, match=r"allowed: 'simple', 'interleaved'$"):
        build_schedule("1f1b", 2, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forward_cost": [1.0]}, "forward_cost: got 1 costs; need one per stage \\(2\\)"),
        ({"backward_cost": -1.0}, "backward_cost: got -1.0"),
        ({"forward_cost": float("nan")}, "forward_cost: got nan"),
        ({"comm_cost": -0.5}, "comm_cost: got -0.5"),
        ({"split_overhead": -0.1}, "split_overhead: got -0.1"),
    ],
)
def test_bad_costs_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Costs.per_stage(2, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="costs: got 3 stages; the schedule has 2"):
        simulate(build_schedule("interleaved", 2, 2), Costs.per_stage(3))


def test_action_validation_and_text() -> None:
    action = Action("SEND_F", 3, 1)
    assert str(action) == "SEND_F3"
    assert repr(action) == "SEND_F3@1"
    assert Action.parse("SEND_F3", 1) == action
    assert Action.parse("0:B2", 1) == Action("B", 2, 0)
    with pytest.raises(ValueError, match="Action kind: got 'X'"):
        Action("X", 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Action microbatch: got -1"):
        Action("F", -1, 0)
    with pytest.raises(ValueError, match="action: got 'G3'"):
        Action.parse("G3", 0)


def test_schedule_shape_validated() -> None:
    with pytest.raises(ValueError, match="got 1 rank lists; need one per stage \\(2\\)"):
        Schedule("interleaved", 2, 1, 1, (rank(0, "F0 B0"),))
    with pytest.raises(ValueError, match="outside 1 stages x 1 microbatches"):
        Schedule("interleaved", 1, 1, 1, (rank(0, "F0 B0 F1"),))


# Text, JSON and Chrome trace.


def test_str_is_a_time_aligned_grid() -> None:
    assert str(build_schedule("interleaved", 2, 4)) == (
        "interleaved pipeline: 2 stages, 4 microbatches, at most 4 in flight\n"
        "rank 0 | F0 F1 F2 F3 B0 -  .  B1 -  B2 -  B3 -\n"
        "rank 1 | .  F0 B0 -  F1 B1 -  F2 I2 F3 I3 W2 W3"
    )
    assert str(build_schedule("simple", 2, 4, split_backward=False)).splitlines()[1:] == [
        "rank 0 | F0 F1 F2 F3 .  .  .  B0 -  B1 -  B2 -  B3 -",
        "rank 1 | .  F0 F1 F2 F3 B0 -  B1 -  B2 -  B3 -  .  .",
    ]


def test_json_round_trip() -> None:
    built = build_schedule("interleaved", 3, 5, 2)
    data = json.loads(built.to_json())
    assert data["pipeline"] == "interleaved"
    assert data["active_microbatches"] == 2
    assert data["actions"][2][:3] == ["RECV_F0", "F0", "I0"]
    assert Schedule.from_json(built.to_json()) == built


def test_chrome_trace_round_trips_through_json(tmp_path: Path) -> None:
    built = build_schedule("interleaved", 3, 4, split_backward=False)
    path = tmp_path / "pipeline.json"
    write_chrome_trace(timeline(built), path)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 2 * 3 * 4  # compute only by default
    assert {(e["pid"], e["name"]) for e in spans} == {
        (stage, f"{kind}{mb}") for stage in range(3) for kind in "FB" for mb in range(4)
    }
    f0_last = next(e for e in spans if e["pid"] == 2 and e["name"] == "F0")
    assert (f0_last["ts"], f0_last["dur"]) == (2e6, 1e6)
    metadata = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    names = {e["pid"]: e["args"]["name"] for e in metadata if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    rows = {e["args"]["name"] for e in metadata if e["name"] == "thread_name"}
    assert rows == {"compute"}  # one row per rank: its computations never overlap


def test_timeline_can_include_communication() -> None:
    built = build_schedule("simple", 2, 2, 2, split_backward=False)
    events = timeline(built, include_comm=True)
    assert {e.kind for e in events} == {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    assert [e.start for e in events] == sorted(e.start for e in events)


# --- recorded runs ------------------------------------------------------------------------------


def _events(rows: dict[int, str]) -> list[TimelineEvent]:
    """``{rank: "F0@0 F0@3 B0@5"}``: compute periods (kind, microbatch, start), 1 long each."""
    events = []
    for rank_, text in rows.items():
        for word in text.split():
            action, start = word.split("@")
            events.append(
                TimelineEvent(rank_, action[0], int(action[1:]), float(start), float(start) + 1)
            )
    return events


def test_a_recorded_run_orders_work_by_first_start_with_chain_messages() -> None:
    events = _events({0: "F1@1 F0@0 B0@6 B0@9 F1@2 B1@10", 1: "F0@3 B0@4 F1@5 B1@8"})
    recorded = recorded_schedule(events, "interleaved", 2, 2, 2)
    assert recorded.actions == (
        rank(0, "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1"),
        rank(1, "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1"),
    )
    check(recorded)


def test_a_recorded_run_that_breaks_a_rule_fails_the_check() -> None:
    over_bound = _events({0: "F0@0 F1@1 B0@5 B1@6", 1: "F0@2 F1@3 B0@4 B1@5"})
    with pytest.raises(ScheduleError, match="2 microbatches in flight, more than"):
        check(recorded_schedule(over_bound, "interleaved", 2, 2, 1))
    backward_early = _events({0: "F0@0 B0@5 F1@6 B1@9", 1: "F0@2 B0@3 F1@7 B1@8"})
    with pytest.raises(ScheduleError, match="backward before its last forward"):
        check(recorded_schedule(backward_early, "simple", 2, 2, 2))


# The split backward: I (input gradients, sent at once) and W (weight gradients).


def test_the_last_backwards_are_split_on_every_stage_but_the_first() -> None:
    built = build_schedule("interleaved", 3, 4)
    assert not any(a.kind in ("I", "W") for a in built.actions[0])
    for stage in (1, 2):
        halves = [a.microbatch for a in built.actions[stage] if a.kind == "I"]
        assert halves == list(range(4 - len(halves), 4)) and halves  # a suffix
        order = [str(a) for a in built.compute_actions(stage)]
        assert all(order.index(f"I{mb}") < order.index(f"W{mb}") for mb in halves)
    assert built.policy.split[0] == 0 and min(built.policy.split[1:]) > 0
    unsplit = build_schedule("interleaved", 3, 4, split_backward=False)
    assert not any(a.kind in ("I", "W") for row in unsplit.actions for a in row)


def test_a_partition_that_recomputes_runs_whole_backwards_while_the_others_split() -> None:
    """pp=3, only partition 1 recomputes checkpointed modules: its backwards are whole, the
    last ones of partition 2 are still split (the leader's never are). The mixed plan passes
    the check, its grid shows both, and it ends sooner than splitting nowhere (what one
    recomputing partition used to cost every partition)."""
    mixed = build_schedule("interleaved", 3, 4, whole_partitions=(1,))
    assert mixed.policy.split == (0, 0, 3)
    check(mixed, whole_partitions=(1,))
    assert str(mixed).splitlines()[1:] == [
        "rank 0 | F0 F1 F2 F3 .  .  .  B0 -  B1 -  B2 -  B3 -",
        "rank 1 | .  F0 F1 F2 F3 B0 -  B1 -  B2 -  B3 -  .  .",
        "rank 2 | .  .  F0 B0 -  F1 I1 F2 I2 F3 I3 W1 W2 W3 .",
    ]
    costs = Costs.per_stage(3, split_overhead=0.2)  # what the plans assume
    unsplit = build_schedule("interleaved", 3, 4, split_backward=False)
    assert simulate(mixed, costs).makespan < simulate(unsplit, costs).makespan
    everywhere = build_schedule("interleaved", 3, 4)
    with pytest.raises(ScheduleError, match="rank 1: B2 is split, but this rank's backwards"):
        check(everywhere, whole_partitions=(1,))


@pytest.mark.parametrize("whole", [(3,), (-1,), ("1",)])
def test_whole_partitions_outside_the_pipeline_are_refused(whole: tuple[object, ...]) -> None:
    message = rf"whole_partitions: got {whole[0]!r}; allowed: partitions 0 to 2"
    for split in (True, False):  # refused whether or not anything splits
        with pytest.raises(ValueError, match=message):
            build_schedule("interleaved", 3, 4, split_backward=split, whole_partitions=whole)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        pipeline_plan(
            SchedulePolicy.for_config("interleaved", 4, 4), [1.0] * 3, [(0, 1.0)], False, whole
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        check(build_schedule("interleaved", 3, 4), whole_partitions=whole)  # type: ignore[arg-type]


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (2, 4), (2, 8), (3, 4), (4, 8)])
def test_weight_halves_in_idle_time_end_the_step_sooner(
    pipeline: str, stages: int, microbatches: int
) -> None:
    """Free splits: the same work, moved into the bubbles; at a fifth more per split, still
    never later than the unsplit plan."""
    free = Costs.per_stage(stages)
    split = simulate(build_schedule(pipeline, stages, microbatches, costs=free), free)
    whole = simulate(build_schedule(pipeline, stages, microbatches, split_backward=False), free)
    assert split.makespan < whole.makespan
    assert sum(split.busy) == pytest.approx(sum(whole.busy))
    dear = Costs.per_stage(stages, split_overhead=0.2)
    assert simulate(build_schedule(pipeline, stages, microbatches), dear).makespan <= (
        whole.makespan
    )


def test_a_split_dearer_than_its_gain_is_not_made() -> None:
    costs = Costs.per_stage(2, split_overhead=1.0)  # each half as long as the whole
    assert build_schedule("interleaved", 2, 8, costs=costs).policy.split == (0, 0)


def test_the_plan_ranks_only_the_leaders_backward_terminal_as_the_runtime_does() -> None:
    """Regression: the planner ranked every action of stage 0 terminal, forwards included, so
    with room to admit every microbatch it planned ``F0 F1 F2 F3 B0 F4 B1 ...`` where the
    runtime's rule (only a leader backward is terminal, and it yields to forwards) runs every
    forward first."""
    built = build_schedule("interleaved", 2, 8, active_microbatches=8)
    forwards, backwards = [f"F{mb}" for mb in range(8)], [f"B{mb}" for mb in range(8)]
    assert [str(a) for a in built.compute_actions(0)] == forwards + backwards
    assert [str(a) for a in build_schedule("interleaved", 2, 8).compute_actions(0)][:6] == [
        "F0",
        "F1",
        "F2",
        "F3",
        "B0",
        "F4",  # 4 in flight: F4 waits for B0's slot
    ]


def test_the_plan_is_what_the_policy_runs() -> None:
    """The list scheduler (the policy choosing among ready work) and the simulator (running
    the resulting lists in order) agree on every action's time."""
    costs = Costs.per_stage(3, [1.0, 1.5, 0.8], [2.2, 3.0, 1.7], 0.3, 0.2)
    for pipeline, microbatches, active in (("interleaved", 6, 3), ("simple", 4, 4)):
        policy = zero_bubble_policy(
            SchedulePolicy.for_config(pipeline, microbatches, active), 3, costs
        )
        plan = schedule_of(policy, 3, costs)
        check(plan)
        timed = simulate(plan, costs)
        for stage in range(3):
            starts = [e.start for e in timed.events[stage] if e.kind in ("F", "B", "I", "W")]
            assert starts == sorted(starts)
        assert plan.policy == policy


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ("RECV_F0 F0 I0 SEND_B0", "microbatch 0 needs B0, or I0 and W0, once each; got 0 B0, 1 I0"),
        ("RECV_F0 F0 W0 I0 SEND_B0", "rank 1: I0 must come before W0"),
        ("RECV_F0 F0 B0 I0 SEND_B0 W0", "got 1 B0, 1 I0, 1 W0"),
    ],
)
def test_check_holds_a_split_backward_to_its_rules(row: str, expected: str) -> None:
    with pytest.raises(ScheduleError, match="invalid schedule") as caught:
        check(schedule("interleaved", 1, 1, "F0 SEND_F0 RECV_B0 B0", row))
    assert expected in str(caught.value)


def test_a_recorded_split_backward_is_checked_like_a_planned_one() -> None:
    events = [
        TimelineEvent(0, "F", 0, 0.0, 1.0),
        TimelineEvent(1, "F", 0, 1.0, 2.0),
        TimelineEvent(1, "I", 0, 2.0, 3.0),
        TimelineEvent(1, "W", 0, 3.0, 4.0),
        TimelineEvent(0, "B", 0, 3.0, 5.0),
    ]
    recorded = recorded_schedule(events, "interleaved", 2, 1, 1)
    assert [str(a) for a in recorded.actions[1]] == ["RECV_F0", "F0", "I0", "SEND_B0", "W0"]
    check(recorded)


def _row(actions: list[tuple[str, int, int]]) -> str:
    """``F0`` for a first visit, ``F0'`` for the microbatch come back."""
    return " ".join(f"{kind}{mb}" + ("'" * visit) for kind, mb, visit in actions)


# Pipeline, split per stage -> each rank's plan row for a head tied to the embedding (0 -> 1 -> 0).
TIED_HEAD_ROWS = [
    (
        "interleaved",
        (),
        "F0 F1 F0' B0' F1' B1' F2 F3 B0 F2' B2' F3' B3' B1 B2 B3",
        "F0 F1 B0 B1 F2 F3 B2 B3",
    ),
    (
        "simple",
        (),
        "F0 F1 F0' F1' F2 F3 F2' F3' B0' B1' B0 B1 B2' B3' B2 B3",
        "F0 F1 F2 F3 B0 B1 B2 B3",
    ),
    (
        "interleaved",
        (0, 2, 0),  # partition 1 splits; the leader's backwards never do
        "F0 F1 F0' B0' F1' B1' F2 F3 B0 F2' B2' F3' B3' B1 B2 B3",
        "F0 F1 B0 B1 F2 F3 I2 W2 I3 W3",
    ),
]


@pytest.mark.parametrize(("pipeline", "split", "leader", "other"), TIED_HEAD_ROWS)
def test_a_microbatch_that_comes_back_to_the_leader_is_planned_a_visit_per_stage(
    pipeline: str, split: tuple[int, ...], leader: str, other: str
) -> None:
    """One core per rank schedules both of the leader's stages, as its one token does: the
    head's forward and backward are the leader's second visit, its backward not terminal
    (partition 1 waits for it), the embedding's backward the first visit, terminal."""
    policy = SchedulePolicy(pipeline, 4, 4, split)
    rows = route_orders(policy, (0, 1, 0), Costs.per_stage(3))
    assert [_row(row) for row in rows] == [leader, other]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_chain_route_plans_what_the_chain_plan_does(stages: int) -> None:
    policy = zero_bubble_policy(
        SchedulePolicy("interleaved", 5, 3), stages, Costs.per_stage(stages)
    )
    rows = route_orders(policy, tuple(range(stages)), Costs.per_stage(stages))
    chain = schedule_of(policy, stages, Costs.per_stage(stages))
    assert [_row(row) for row in rows] == [
        " ".join(map(str, chain.compute_actions(rank))) for rank in range(stages)
    ]


@pytest.mark.parametrize("route", [(1, 0), (0, 2, 1), (0, 1, 0, 1), (0, 0), ()])
def test_a_route_a_plan_order_cannot_serve_is_refused(route: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"route: got .*; allowed: partitions 0, 1, \.\.\."):
        route_orders(
            SchedulePolicy("interleaved", 2, 2), route, Costs.per_stage(max(len(route), 1))
        )

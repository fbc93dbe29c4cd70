"""The scheduling core's rules as tables: no threads, no processes, no model."""

from __future__ import annotations

import pytest

from dtrain.modelparallel.scheduling.order import PlanRow
from dtrain.modelparallel.scheduling.ordering import FreeOrdering, PlannedOrdering
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.scheduler import Scheduler, Work


def _work(text: str, role: str = "serve", step: int = 0) -> Work:
    """``"F2"`` -> a forward of microbatch 2."""
    return Work(role, int(text[1:]), text[0], step=step)  # type: ignore[arg-type]


def _core(pipeline: str = "interleaved", microbatches: int = 4, active: int = 4) -> Scheduler:
    return Scheduler(SchedulePolicy(pipeline, microbatches, active), FreeOrdering(), Work("main"))


def _planned(plan: PlanRow, rank: int = 0) -> tuple[Scheduler, PlannedOrdering]:
    """A core following ``plan`` (rank ``rank``'s row), and its ordering."""
    ordering = PlannedOrdering(plan, rank)
    return Scheduler(SchedulePolicy("interleaved", 4, 4), ordering, Work("main")), ordering


def _holding(core: Scheduler, text: str, role: str = "serve") -> Work:
    """``core`` with ``text`` holding the token (granted from a free token)."""
    work = _work(text, role)
    core.submit(work)
    assert core.grant() is work
    return work


# The terminal rule: role, phase, remote backwards still to come -> terminal.
TERMINAL = [
    ("leader", "B", 0, True),
    ("leader", "B", 1, False),  # another rank still waits for a backward request from it
    ("leader", "F", 0, False),  # a forward is never terminal (the planner's old mistake)
    ("serve", "B", 0, False),
    ("serve", "I", 0, False),
    ("leader", "W", 0, False),
]


@pytest.mark.parametrize(("role", "phase", "remote", "terminal"), TERMINAL)
def test_only_a_leader_backward_nobody_waits_for_is_terminal(
    role: str, phase: str, remote: int, terminal: bool
) -> None:
    work = Work(role, 2, phase)  # type: ignore[arg-type]
    work.remote_nodes[1] += remote
    assert work.terminal is terminal


# Holder between computations, waiting work -> gives the token up (outranked)?
STICKY = [
    ("interleaved", "F1", [], False),
    ("interleaved", "F1", ["F2"], False),  # the next module of the same microbatch follows
    ("interleaved", "F1", ["F0"], True),
    ("interleaved", "F1", ["B3"], True),  # backward first
    ("interleaved", "B1", ["F0"], False),
    ("interleaved", "I1", ["W0"], False),  # a weight half waits for idle time
    ("interleaved", "W1", ["F3"], True),
    ("simple", "F1", ["B0"], False),  # simple: every forward first
    ("simple", "B1", ["F3"], True),
]


@pytest.mark.parametrize(("pipeline", "holder", "waiting", "outranked"), STICKY)
def test_a_holder_keeps_the_token_unless_more_urgent_work_waits(
    pipeline: str, holder: str, waiting: list[str], outranked: bool
) -> None:
    core = _core(pipeline)
    work = _holding(core, holder)
    core.between(work)
    for text in waiting:
        core.submit(_work(text))
    assert core.outranked(work) is outranked
    assert core.grant() is None  # held: nobody else gets it while the holder decides


def test_a_leaders_terminal_backward_gives_way_to_a_forward() -> None:
    core = _core()
    backward = _holding(core, "B0", role="leader")
    core.submit(_work("F3", role="leader"))
    assert core.outranked(backward)  # give_way at its weights lets the forward go first
    backward.remote_nodes[1] += 1  # not terminal: a backward request still has to go out
    assert not core.outranked(backward)


# A holder about to send a reply: sticky?, anything eligible waiting? -> steps aside.
STEP_ASIDE = [
    (True, ["F3"], True),  # any waiter, even a less urgent one, computes meanwhile
    (True, [], False),
    (False, ["F3"], False),  # inside a computation: it is not between two
]


@pytest.mark.parametrize(("between", "waiting", "steps_aside"), STEP_ASIDE)
def test_a_holder_between_computations_steps_aside_to_send(
    between: bool, waiting: list[str], steps_aside: bool
) -> None:
    core = _core()
    work = _holding(core, "B0")
    if between:
        core.between(work)
    for text in waiting:
        core.submit(_work(text))
    assert core.steps_aside(work) is steps_aside
    core.resume(work)
    assert not core.steps_aside(work)


def test_with_a_plan_a_holder_whose_action_ended_steps_aside_to_send() -> None:
    """Its last backward computed, a served request sends its reply: the plan's next action
    computes meanwhile (the turn passes once the holder gives the token up), as the dynamic
    runtime lets whatever is ready compute."""
    core, ordering = _planned((("B", 0), ("F", 1)), 1)
    work = _holding(core, "B0")
    core.between(work)
    forward = _work("F1")
    core.submit(forward)
    assert not core.steps_aside(work)  # B0's turn goes on
    ordering.end(0, "B", 0)
    assert core.steps_aside(work)
    core.release(work)
    assert core.grant() is forward


def test_the_token_goes_to_the_first_ranked_and_is_released_only_by_its_holder() -> None:
    core = _core()
    for text in ("F2", "W0", "B1", "F1"):
        core.submit(_work(text))
    served = []
    while (work := core.grant()) is not None:
        served.append(f"{work.phase}{work.microbatch}")
        with pytest.raises(RuntimeError, match="does not hold"):
            core.release(_work("F9"))
        core.release(work)
    assert served == ["B1", "F1", "F2", "W0"]
    assert core.waiting == 0


# Announced work (dispatched, thread not started) keeps its place against later work.
ANNOUNCED = [
    # pipeline, announced, then asking, first granted
    ("simple", ["F0"], ["F1"], None),  # F0 came first: the token waits for it
    ("interleaved", ["F3"], ["B1"], "B1"),  # more urgent than the announced one
    ("simple", ["F0"], ["F0", "F1"], "F0"),
]


@pytest.mark.parametrize(("pipeline", "announced", "asking", "first"), ANNOUNCED)
def test_announced_work_keeps_its_place_in_line(
    pipeline: str, announced: list[str], asking: list[str], first: str | None
) -> None:
    core = _core(pipeline)
    works = {text: _work(text) for text in {*announced, *asking}}
    for text in announced:
        core.announce(works[text])
    for text in asking:
        core.submit(works[text])
    granted = core.grant()
    assert (None if granted is None else f"{granted.phase}{granted.microbatch}") == first


def test_announced_work_that_never_asks_stops_holding_others_up() -> None:
    core = _core("simple")
    never, later = _work("F0"), _work("F1")
    core.announce(never)
    core.submit(later)
    assert core.grant() is None
    assert core.withdraw(never) and not core.withdraw(never)
    assert core.grant() is later


# Admission: pipeline, microbatches, active, admitted, finished -> in flight, may admit.
ADMISSION = [
    ("interleaved", 8, 4, 3, 0, 3, True),
    ("interleaved", 8, 4, 4, 0, 4, False),
    ("interleaved", 8, 4, 5, 1, 4, False),
    ("interleaved", 8, 4, 5, 2, 3, True),
    ("simple", 4, 4, 4, 0, 4, False),
]


@pytest.mark.parametrize(
    ("pipeline", "microbatches", "active", "admitted", "finished", "in_flight", "admit"),
    ADMISSION,
)
def test_the_leader_admits_while_fewer_than_active_are_in_flight(
    pipeline: str,
    microbatches: int,
    active: int,
    admitted: int,
    finished: int,
    in_flight: int,
    admit: bool,
) -> None:
    core = _core(pipeline, microbatches, active)
    core.begin_step()
    assert [core.admit() for _ in range(admitted)] == list(range(admitted))
    for mb in range(finished):
        core.finished(Work("leader", mb, "B"))
    assert core.in_flight == in_flight
    assert core.may_admit() is admit
    core.begin_step()  # the next step starts empty
    assert core.in_flight == 0 and core.may_admit()


# The simple hold: pipeline, forwards done (or tasks finished) -> a backward may start.
HOLD = [
    ("simple", [0, 1, 2], [], False),
    ("simple", [0, 1, 2, 3], [], True),
    ("simple", [0, 1, 2], [3], True),  # a task that failed in its forward counts as done
    ("interleaved", [], [], True),
]


@pytest.mark.parametrize(("pipeline", "forwards", "failed", "may_start"), HOLD)
def test_simple_holds_every_backward_until_every_forward_is_done(
    pipeline: str, forwards: list[int], failed: list[int], may_start: bool
) -> None:
    core = _core(pipeline)
    core.begin_step()
    for mb in forwards:
        core.forward_done(mb)
    for mb in failed:
        core.finished(Work("leader", mb))
    assert core.backward_may_start() is may_start


def test_while_the_main_task_waits_only_owed_weight_halves_compute() -> None:
    """At a step's end the main task (the optimizer step comes next) waits for the weight
    halves owed; nothing else goes first (a request of the next step waits)."""
    core = _core()
    weights, next_step = _work("W1", step=0), _work("F0", step=1)
    core.owe(0, 1)
    core.submit(core.main)  # type: ignore[arg-type]
    core.submit(next_step)
    assert core.grant() is None
    core.submit(weights)
    assert core.grant() is weights
    core.release(weights)
    assert core.grant() is None  # still owed until it says it has run
    core.paid(0, 1)
    assert core.grant() is core.main


def test_a_weight_half_ends_its_action_only_once_paid_even_after_the_reply() -> None:
    """Owed before the backward replies: the end of the microbatch that the reply leads to
    does not end the weight half's action in the plan order; paying it (it ran, or failed:
    the executor pays in a ``finally``) does."""
    core, ordering = _planned((("F", 0), ("B", 0), ("W", 0), ("F", 1)))
    core.owe(0, 0)
    assert core.end_microbatch(0, 0)
    assert core.owes(0, 0) and ordering.order(0).describe() == "W0"
    assert not core.in_turn(_work("F1"))
    core.paid(0, 0)
    assert not core.owes(0, 0) and core.in_turn(_work("F1"))
    with pytest.raises(ValueError):
        core.paid(0, 0)  # paid twice: a bug, not a second half


def test_a_microbatchs_weight_action_waits_for_every_half_of_its_modules_backwards() -> None:
    """A rank whose two modules the caller calls one by one gets two backward requests of a
    microbatch. The first split (its weight half owed), the last ran whole: its end must not
    end the weight action while the first's half is owed (that half then found its action over
    and failed, at random, as timing decided the split). A half paid before the microbatch's
    last backward ran does not end it either."""
    plan = (("F", 0), ("B", 0), ("W", 0), ("F", 1))
    core, ordering = _planned(plan, 1)
    ordering.end(0, "F", 0)
    core.owe(0, 0)  # the first module's backward split
    assert core.end_backward(0, 0)  # the second module's, the last, ran whole
    assert ordering.order(0).describe() == "W0" and ordering.off_plan(_work("W0")) is None
    core.paid(0, 0)
    assert core.in_turn(_work("F1"))

    core, ordering = _planned(plan, 1)
    ordering.end(0, "F", 0)
    core.owe(0, 0)
    core.paid(0, 0)  # the first half ran before the last backward arrived
    assert ordering.order(0).describe() == "B0" and ordering.off_plan(_work("W0")) is None
    core.owe(0, 0)  # the last backward split too
    core.end_backward(0, 0)
    assert ordering.order(0).describe() == "W0"
    core.paid(0, 0)
    assert core.in_turn(_work("F1"))


# A plan order: actions ended -> whose work may compute.
PLAN = (("F", 0), ("F", 1), ("B", 0), ("W", 0), ("B", 1))
IN_TURN = [
    ([], "F0"),
    ([("F", 0)], "F1"),
    ([("F", 1)], "F0"),  # ended ahead of its turn: passes at once when it comes
    ([("F", 0), ("F", 1)], "B0"),
    ([("F", 0), ("F", 1), ("B", 0)], "W0"),
]


@pytest.mark.parametrize(("ended", "current"), IN_TURN)
def test_with_a_plan_order_only_the_current_actions_work_computes(
    ended: list[tuple[str, int]], current: str
) -> None:
    core, ordering = _planned(PLAN)
    for phase, mb in ended:
        assert ordering.end(0, phase, mb)
    in_turn = [t for t in ("F0", "F1", "B0", "I0", "W0", "B1") if core.in_turn(_work(t))]
    assert in_turn == ([current, "I0"] if current == "B0" else [current])  # I counts as B
    assert core.in_turn(core.main)  # type: ignore[arg-type]
    for text in ("F1", "F0", "B0", "W0"):
        core.submit(_work(text))
    granted = core.grant()
    assert granted is not None and f"{granted.phase}{granted.microbatch}" == current


def test_with_the_free_ordering_ending_an_action_changes_nothing() -> None:
    core = _core()
    assert not core.end_backward(0, 0) and not core.end_microbatch(0, 0)
    assert not core.ordering.ended(0, "F", 0) and core.in_turn(_work("B3"))


# A plan order's shape: rank, work (role, phase+mb), actions ended -> where it cannot be ordered.
OFF_PLAN = [
    (0, "leader", "F0", [], None),
    (0, "leader", "F0", [("F", 0)], "on partition 0 after microbatch 0 waited"),
    (0, "serve", "F0", [], "on partition 0, called from another partition"),
    (1, "serve", "F0", [], None),
    (1, "serve", "F0", [("F", 0)], "on partition 1 after microbatch 0's forward here was over"),
    (1, "serve", "I0", [("F", 0), ("F", 1), ("B", 0)], "microbatch 0's backward here was over"),
    (1, "serve", "I0", [("B", 0)], None),  # said over ahead of its turn: its work may still come
]


@pytest.mark.parametrize(("rank", "role", "work", "ended", "where"), OFF_PLAN)
def test_work_a_plan_order_cannot_order_is_named(
    rank: int, role: str, work: str, ended: list[tuple[str, int]], where: str | None
) -> None:
    _, ordering = _planned(PLAN, rank)
    for phase, mb in ended:
        ordering.end(0, phase, mb)
    found = ordering.off_plan(_work(work, role))
    assert (found is None) if where is None else (found is not None and where in found)


def test_the_leaders_forward_ends_when_it_waits_and_its_task_ends_the_rest() -> None:
    core, ordering = _planned((("F", 0), ("B", 0), ("W", 0)))
    core.begin_step()
    core.admit()
    assert not ordering.visit_over(_work("F0"))  # a served forward's end is the leader's to say
    assert ordering.visit_over(_work("F0", role="leader")) and ordering.order(0).describe() == "B0"
    assert not ordering.visit_over(_work("B0", role="leader"))
    core.finished(_work("B0", role="leader"))
    assert ordering.order(0).describe() == "W0" and core.in_flight == 0


def test_an_end_that_overtakes_its_work_waits_for_it() -> None:
    """The leader's notice that a forward is over can be dispatched before the request it
    follows has computed here (its task only announced): the turn passes once that work has
    run, not before (it would then be refused as coming too late)."""
    core, ordering = _planned((("F", 0), ("F", 1), ("B", 0)), 1)
    forward, next_forward = _work("F0"), _work("F1")
    core.announce(forward)
    assert ordering.end(0, "F", 0)
    core.submit(next_forward)
    assert ordering.order(0).describe() == "F0" and core.grant() is None
    core.submit(forward)
    assert core.grant() is forward and ordering.off_plan(forward) is None
    core.release(forward)
    assert ordering.order(0).describe() == "F1" and core.grant() is next_forward


def test_announced_work_out_of_turn_does_not_hold_up_the_turn() -> None:
    """Regression (a deadlock in the pipeline benchmark): a backward request dispatched before
    the forward whose turn comes first was announced, and, more urgent, kept the forward from
    the token, while its own thread waited for its turn after that forward."""
    core, _ = _planned((("F", 1), ("B", 3)), 1)
    backward, forward = _work("B3"), _work("F1")
    core.announce(backward)
    core.submit(forward)
    assert core.grant() is forward


# A head tied to the embedding (route 0 -> 1 -> 0): the leader's plan row has a forward and a
# backward per visit. Step by step: the leader's work, what happens, what the core answers
# (whether the token may go on, or the forward came back), then the turn and the work's visit.
TIED_HEAD_PLAN = (("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("F", 1, 0), ("B", 0, 0))
TIED_HEAD = [
    ("F", "computes", None, "F0", 0),  # the embedding and the first blocks
    ("F", "waits", True, "F0 (visit 1)", 0),  # its forward left for partition 1: visit 0 over
    ("F", "waits", False, "F0 (visit 1)", 0),  # the root's code fetches again: nothing ends
    ("F", "returns", True, "F0 (visit 1)", 1),  # back to compute the head: the next visit
    ("F", "computes", None, "F0 (visit 1)", 1),
    ("B", "starts backward", None, "B0 (visit 1)", 1),  # the head's backward first
    ("B", "sends", False, "B0 (visit 1)", 1),  # partition 1 gets gradients, more to send
    ("B", "returns", False, "B0 (visit 1)", 1),  # the root's code between them: same visit
    ("B", "sends", True, "F1", 1),  # the visit's last backward request: visit 1 over
    ("B", "returns", False, "F1", 0),  # the embedding's backward: visit 0, after F1's turn
]


def test_a_microbatch_that_comes_back_to_the_leader_follows_a_turn_per_visit() -> None:
    core, ordering = _planned(TIED_HEAD_PLAN)
    work = Work("leader", 0, "F")
    for phase, event, answer, turn, visit in TIED_HEAD:
        work.phase = phase  # type: ignore[assignment]
        if event == "computes":
            core.computes(work)
        elif event == "waits":
            assert ordering.visit_over(work) is answer, event
        elif event == "sends":
            work.remote_nodes[1] -= 1
            assert ordering.visit_over(work) is answer, event
        elif event == "returns":
            assert ordering.returns(work) is answer, event
            assert ordering.off_plan(work) is None
        else:
            assert ordering.end(0, "F", 0)  # every visit of its forward is over
            work.remote_nodes[1] += 2  # two outputs of partition 1 on its graph
        assert ordering.order(0).describe() == turn and work.visit == visit, event
    assert not core.in_turn(work)  # F1 first
    ordering.end(0, "F", 1)
    assert core.in_turn(work) and not ordering.visit_over(
        work
    )  # no earlier visit: waits in its turn


# The leader's forward calls partition 1's layers one by one from a module of its own, each
# call waiting for its reply (its outputs' structure not known yet: the first step): between
# them it only resumes the module's code, which would have gone on without waiting had the
# calls been deferred. Event, the core's answer, then the turn and the work's visit.
REPLIES = [
    ("computes", None, "F0", 0),  # the embedding and the first layers
    ("waits for a reply", False, "F0", 0),  # the layer on partition 1: not over yet
    ("waits for a reply", False, "F0", 0),  # the next layer there, called after the first
    ("comes back", True, "F0 (visit 1)", 0),  # computes here again: visit 0 was over
    ("returns", True, "F0 (visit 1)", 1),  # the head: the next visit, partition 1 done
    ("comes back", False, "F0 (visit 1)", 1),  # once only
]


def test_a_forward_waiting_for_replies_ends_its_visit_when_it_computes_here_again() -> None:
    core, ordering = _planned(TIED_HEAD_PLAN)
    work = Work("leader", 0, "F")
    for event, answer, turn, visit in REPLIES:
        if event == "computes":
            core.computes(work)
        elif event == "waits for a reply":
            assert ordering.visit_over(work, reply=True) is answer, event
        elif event == "comes back":
            assert ordering.back_from_replies(work) is answer, event
        else:
            assert ordering.returns(work) is answer, event
            assert ordering.off_plan(work) is None
        assert ordering.order(0).describe() == turn and work.visit == visit, event


def test_a_wait_for_a_value_after_replies_ends_the_visit_once() -> None:
    """The root's code fetching an output after the calls: the visit ends there, as without
    the replies, and computing afterwards does not end the next visit too."""
    core, ordering = _planned(TIED_HEAD_PLAN)
    work = Work("leader", 0, "F")
    core.computes(work)
    assert not ordering.visit_over(work, reply=True)
    assert ordering.visit_over(work) and ordering.order(0).describe() == "F0 (visit 1)"
    assert not ordering.back_from_replies(work) and ordering.returns(work) and work.visit == 1


def test_in_a_chain_plan_a_forward_waiting_for_a_reply_ends_its_action() -> None:
    """No later visit: nothing is kept open (as before replies were told apart)."""
    core, ordering = _planned((("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)))
    work = Work("leader", 0, "F")
    core.computes(work)
    assert ordering.visit_over(work, reply=True) and ordering.order(0).describe() == "F1"
    assert not ordering.back_from_replies(work)


def test_a_forward_with_no_visit_left_still_fails_naming_where() -> None:
    core, ordering = _planned((("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)))
    work = Work("leader", 0, "F")
    for _ in range(2):
        core.computes(work)
        ordering.visit_over(work)
        ordering.returns(work)  # the second time: the plan has no third visit
    assert work.visit == 1 and "after microbatch 0 waited" in (ordering.off_plan(work) or "")


def test_a_forward_that_never_comes_back_as_planned_says_so() -> None:
    """A plan made for a route back to the leader, run by a model whose forward ends on
    partition 1's return without computing on partition 0 again: its backward would wait for
    the head's turn forever; it fails instead, naming the visit."""
    core, ordering = _planned(TIED_HEAD_PLAN)
    work = Work("leader", 0, "F")
    core.computes(work)
    ordering.visit_over(work)
    assert "ended at visit 0 of partition 0" in (ordering.missed_visit(work) or "")
    ordering.returns(work)
    assert ordering.missed_visit(work) is None

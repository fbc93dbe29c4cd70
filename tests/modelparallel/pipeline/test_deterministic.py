"""``deterministic_server``: every rank computes in the plan's order, the same on every
data-parallel replica, and trains like one process, a tied head's visits to the leader
included."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dtrain.modelparallel as smp
from dtrain.modelparallel.api import partitioning
from dtrain.modelparallel.api.partitioning import check_own_code_placement, with_own_code
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.pipeline.executor import Executor, Task
from dtrain.modelparallel.plan.profile import profile_module
from dtrain.modelparallel.scheduling.ordering import PlannedOrdering
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.transport.message import NOTICE, Message
from tests.modelparallel.equivalence import ALL_CASES, case_pipeline, reference, replica_rows
from tests.modelparallel.harness import run_ranks, single_process
from tests.modelparallel.test_equivalence import assert_equivalent

STEPS = 4
MICROBATCHES = 4


def _collapsed(keys: list[tuple[str, int, int]]) -> list[str]:
    """Actions in order (``F0``, or ``F0.1`` at visit 1), a run of periods of one action
    counted once."""
    shown: list[str] = []
    for kind, mb, visit in keys:
        text = f"{kind}{mb}" + (f".{visit}" if visit else "")
        if not shown or shown[-1] != text:
            shown.append(text)
    return shown


def _train_in_plan_order(
    case_name: str, partitions: int = 2, auto: bool = False, checkpointed: str | None = None
) -> dict[str, Any]:
    """Train in plan order; ``checkpointed`` names a block to recompute, whose owner counts
    its attention's forwards (the block's own hooks miss the recomputation). Partitioned
    automatically (``auto``), the model is profiled without timing, as one on the meta device
    is: its plan follows the exact operation counts, where timings would follow the machine's
    load (which backwards the plan splits changed with it)."""
    if auto:
        partitioning.profile_module = functools.partial(profile_module, repeats=0)
    dist.init_process_group("gloo")
    smp.init({"pipeline_parallel_degree": partitions, "microbatches": MICROBATCHES,
              "auto_partition": auto, "default_partition": 0, "deterministic_server": True,
              "ddp": dist.get_world_size() > partitions})  # fmt: skip
    case = ALL_CASES[case_name]
    model, step = case_pipeline(case, auto=auto)
    forwards = [0]
    if checkpointed is not None:
        module = model.module.get_submodule(checkpointed)
        smp.set_activation_checkpointing(module)
        if smp.pp_rank() == case.split[checkpointed]:  # a hook here fires where it runs
            module.attn.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    losses, orders = [], []
    for index in range(STEPS):
        losses.append(step(*replica_rows(*case.batch(index))))
        events = sorted(model.timeline(), key=lambda e: e.start)
        orders.append(_collapsed([(e.kind, e.microbatch, e.visit) for e in events]))
    schedule = model.pipeline_schedule()
    plan = _collapsed(list(schedule.plan_row(smp.pp_rank())))
    params = model.state_dict()
    smp.shutdown()
    dist.destroy_process_group()
    return {
        "losses": losses,
        "orders": orders,
        "plan": plan,
        "params": params,
        "printed": str(schedule),
        "forwards": forwards[0],
    }


def test_every_rank_computes_in_the_plans_order_on_every_replica() -> None:
    ranks = run_ranks(4, _train_in_plan_order, "grouped", timeout=240)
    for rank in ranks:
        for order in rank["orders"]:  # the first step too (its calls wait for their replies)
            assert order == rank["plan"]
    assert ranks[0]["plan"] == ranks[2]["plan"] and ranks[1]["plan"] == ranks[3]["plan"]
    assert any(action.startswith("W") for action in ranks[1]["plan"])  # split backwards too
    expected = reference("grouped", STEPS)
    losses = [sum(pair) / 2 for pair in zip(ranks[0]["losses"], ranks[2]["losses"], strict=True)]
    for replica in (ranks[0], ranks[2]):
        got = type(expected)(losses, replica["params"])
        assert_equivalent(got, expected, "deterministic_server, pp=2 x dp=2")


def test_three_partitions_compute_in_the_plans_order_and_train_like_one_process() -> None:
    """A chain of three partitions whose activations relay through the leader, which computes
    the loss from the last partition's outputs: every rank's forward of a microbatch ends as
    the leader's forward moves on from it, so no rank waits for a later one's turn (before,
    it deadlocked). Every step runs each rank's plan row, the same every step. Partition 1
    recomputes its checkpointed block, once per backward: its backwards run whole, while
    partition 2 still splits its last ones (the plan mixes both)."""
    ranks = run_ranks(3, _train_in_plan_order, "lm3", 3, False, "blocks.1", timeout=240)
    for rank in ranks:
        assert all(order == rank["plan"] for order in rank["orders"])
    assert not any(action[0] in "IW" for action in ranks[1]["plan"])
    assert any(action.startswith("W") for action in ranks[2]["plan"])
    assert ranks[1]["forwards"] == 2 * STEPS * MICROBATCHES
    expected = reference("lm3", STEPS)
    got = type(expected)(ranks[0]["losses"], ranks[0]["params"])
    assert_equivalent(got, expected, "deterministic_server, pp=3")


def test_a_tied_head_computes_in_the_plans_order_and_trains_like_one_process() -> None:
    """The LM's head shares its weight with the embedding, so it stays on partition 0 while
    the last blocks are on partition 1: each microbatch's forward comes back to the leader
    (route 0 -> 1 -> 0). The plan has an action per visit, and every step runs each rank's
    plan row, visits included (the root's code fetching the blocks' output between them).
    Partitioned automatically: the plan, made for the model's operation counts, splits
    partition 1's backwards, each microbatch's in two requests (the root's skip connection),
    so it owes two weight halves, whose action ends after both."""
    ranks = run_ranks(2, _train_in_plan_order, "lm", 2, True, timeout=240)
    leader, blocks = ranks
    assert "route 0 -> 1 -> 0" in leader["printed"] and "2:F0" in leader["printed"]
    for rank in ranks:
        assert all(order == rank["plan"] for order in rank["orders"])
    assert {"F0.1", "B0.1"} <= set(leader["plan"]) and {"F0", "B0"} <= set(leader["plan"])
    assert not any("." in action for action in blocks["plan"])
    assert any(action.startswith("W") for action in blocks["plan"])
    expected = reference("lm", STEPS)
    got = type(expected)(leader["losses"], leader["params"])
    assert_equivalent(got, expected, "deterministic_server, tied head, pp=2")


def test_three_partitions_and_a_tied_head_compute_in_the_plans_order() -> None:
    """Route 0 -> 1 -> 2 -> 0: the leader relays the activations and computes the head after
    the last partition; every step runs each rank's plan row and trains like one process."""
    ranks = run_ranks(3, _train_in_plan_order, "lm3tied", 3, timeout=240)
    assert "route 0 -> 1 -> 2 -> 0" in ranks[0]["printed"]
    for rank in ranks:
        assert all(order == rank["plan"] for order in rank["orders"])
    assert "F0.1" in ranks[0]["plan"]
    expected = reference("lm3tied", STEPS)
    got = type(expected)(ranks[0]["losses"], ranks[0]["params"])
    assert_equivalent(got, expected, "deterministic_server, tied head, pp=3")


def _unused_module_last(partitions: int) -> None:
    """GroupedNet with a module registered last and never called: its registration order
    goes back to partition 0, its forward does not."""
    dist.init_process_group("gloo")
    smp.init({"pipeline_parallel_degree": partitions, "microbatches": 2,
              "auto_partition": False, "default_partition": 0,
              "deterministic_server": True})  # fmt: skip
    case = ALL_CASES["grouped"]
    module = case.build()
    smp.set_partition(module.get_submodule("group2"), 1)
    module.unused = torch.nn.Linear(2, 2)
    model = smp.DistributedModel(module)

    @smp.step
    def train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> None:
        model.backward(case.loss(model, x, y))

    try:
        train_step(model, *case.batch(0))
    finally:
        smp.shutdown()
        dist.destroy_process_group()


def test_a_forward_that_does_not_come_back_as_registered_fails_naming_the_visit() -> None:
    with pytest.raises(Exception, match="deterministic_server") as caught:
        run_ranks(2, _unused_module_last, 2, timeout=120)
    message = str(caught.value)
    assert "forward ended at visit 0 of partition 0, but the plan has it come back" in message


def _lm_head(**kwargs: Any) -> torch.nn.Module:
    sizes = {"num_layers": 2, "num_attention_heads": 2, "attention_head_size": 4,
             "hidden_size": 8, "intermediate_size": 16, "vocab_size": 16,
             "num_positions": 4}  # fmt: skip
    with single_process({}):
        return smp.nn.DistributedTransformerLMHead(**sizes, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "head", "fails"),
    [({"tie_word_embeddings": False}, 1, True), ({"tie_word_embeddings": False}, 0, False),
     ({"add_lm_head": False}, 1, False)],
)  # fmt: skip
def test_a_head_placed_away_from_the_code_computing_on_it_fails_naming_it(
    kwargs: dict[str, Any], head: int, fails: bool
) -> None:
    """The LM head's own code (on the root's partition 0) computes the loss on its head's
    logits: a head on partition 1 would take each microbatch back and forth twice, which no
    plan row serves (checked where ranks follow plans, before the first step). Without a head
    there is nothing to check; the automatic partition keeps the head on partition 0."""
    module = _lm_head(**kwargs)
    assert with_own_code(module) == ({} if "add_lm_head" in kwargs else {"lm_head": ""})
    wrapped = torch.nn.Sequential(module)  # inside a model of the user's: the same rule
    assert with_own_code(wrapped) == ({} if "add_lm_head" in kwargs else {"0.lm_head": "0"})

    for root, name in ((module, "lm_head"), (wrapped, "0.lm_head")):

        def owner(module_name: str, name: str = name) -> int:
            return head if module_name == name else 0

        if not fails:
            check_own_code_placement(root, owner)
            continue
        with pytest.raises(ModelParallelError, match=f"module '{name}' is placed on partition 1"):
            check_own_code_placement(root, owner)


def _task(text: str, step: int = 1) -> Task:
    return Task("serve", int(text[1:]), phase=text[0], step=step)  # type: ignore[arg-type]


def _forward_over(microbatch: int) -> Message:
    """The leader's notice that this rank's forward of ``microbatch`` (step 1) is over."""
    return Message(NOTICE, 0, body="forward", microbatch=microbatch, step=1)


def test_the_token_follows_the_plan_not_the_policy() -> None:
    """Without threads: waiting tasks get the token only in their action's turn."""
    plan = (("F", 0), ("F", 1), ("B", 0), ("W", 0))
    executor = Executor(1, SchedulePolicy("interleaved", 2, 2), 1.0, PlannedOrdering(plan, 1))
    executor.release(executor.main)
    backward, second, first = _task("B0"), _task("F1"), _task("F0")
    for task in (backward, second, first):
        executor.enqueue(task)
    assert [t.granted.is_set() for t in (backward, second, first)] == [False, False, True]
    executor.await_token(first)
    executor.release(first)
    assert not second.granted.is_set()  # F0's turn lasts until its end is known
    executor.notices.heard(_forward_over(0))
    assert second.granted.is_set() and not backward.granted.is_set()
    executor.await_token(second)
    executor.notices.heard(_forward_over(1))
    executor.release(second)
    assert backward.granted.is_set()
    executor.await_token(backward)
    executor.release(backward)
    other_step = _task("F0", step=2)  # each step has its own turns
    executor.enqueue(other_step)
    assert other_step.granted.is_set()

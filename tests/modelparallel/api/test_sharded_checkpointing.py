"""Activation checkpointing with sharded data parallelism trains like one process without it.

``smp.set_activation_checkpointing`` (before and after ``smp.DistributedModel``, modules and
``nn.Sequential`` strategies), SMP's ``checkpoint`` and torch's checkpoint (reentrant or
not) in the model's code, at ``sharded_data_parallel_degree`` 2 on the blocks of
``test_activation_checkpointing``: the same losses and parameters as one process without
checkpointing, and each checkpointed block's forward runs twice per microbatch on every rank
(its recomputation in backward), so a mark the sharded model skipped fails the test. The
FSDP2 units are the blocks (a marked block is checkpointed inside its unit, a marked
Sequential or root holds units) or, at a lower threshold, the blocks' linear layers (a marked
block holds units). All setups share one world.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from tests.modelparallel.harness import run_ranks
from tests.modelparallel.modules.test_activation_checkpointing import (
    BATCH,
    BLOCKS,
    STEPS,
    Setup,
    Trained,
    _mark,
    _marked,
    _Net,
    _sum_step,
    _train_steps,
    reference,
)
from tests.modelparallel.test_equivalence import assert_equivalent

BLOCK_UNITS = 200
"""``sdp_param_persistence_threshold`` making each block (280 parameters) a unit."""
LINEAR_UNITS = 100
"""Making each of a block's linear layers (136 and 144 parameters) a unit instead."""


@dataclass(frozen=True)
class Case:
    setup: Setup
    recomputed: tuple[str, ...]
    """The blocks whose forward runs again in backward."""
    threshold: int = BLOCK_UNITS


CASES: dict[str, Case] = {
    "blocks": Case(Setup(_marked("first", "second")), ("first", "second")),
    "blocks holding units": Case(
        Setup(_marked("first", "second"), marks_after_wrapping=True),
        ("first", "second"),
        LINEAR_UNITS,
    ),
    "sequential contiguous": Case(
        Setup(_marked("seq", strategy="contiguous"), marks_after_wrapping=True),
        ("seq.0", "seq.1", "seq.2", "seq.3"),
    ),
    "sequential group_3": Case(
        Setup(_marked("seq", strategy="group_3")), ("seq.0", "seq.1", "seq.2", "seq.3")
    ),
    "whole model": Case(Setup(_marked(""), marks_after_wrapping=True), BLOCKS),
    "delayed model": Case(Setup(_marked("first"), delayed=True), ("first",)),
    "smp checkpoint": Case(Setup(code="smp"), ("first", "second")),
    "torch non-reentrant": Case(Setup(code="torch_non_reentrant"), ("second",)),
    "torch reentrant": Case(Setup(code="torch_reentrant"), ("second",)),
    "nothing": Case(Setup(), ()),
}

DROPOUT: dict[str, Case] = {
    # Dropout in ``second``: the ranks' rows draw apart from one process's, so each run is
    # compared with the same layout unmarked.
    "dropout unmarked": Case(Setup(dropout_in="second"), ()),
    "dropout preserved": Case(Setup(_marked("second"), dropout_in="second"), ("second",)),
    "dropout not preserved": Case(
        Setup(_marked("second", preserve_rng_state=False), dropout_in="second"), ("second",)
    ),
}


def _train(case: Case) -> tuple[Trained, int]:
    """``STEPS`` SGD steps at sdp=2 on this rank's rows, the marks as the case says; the global
    losses, full parameters and forwards of each block on this rank, and the elements autograd
    saved for backward outside checkpointed regions (inside one, the checkpoint's own hooks
    take them and keep nothing)."""
    setup = case.setup
    smp.init(
        {
            "ddp": True,
            "microbatches": setup.microbatches,
            "sharded_data_parallel_degree": 2,
            "sdp_param_persistence_threshold": case.threshold,
            "sdp_gradient_clipping": 0.0,
        }
    )
    with smp.delay_param_initialization(enabled=setup.delayed):
        module = _Net(setup)
    if not setup.marks_after_wrapping:
        _mark(module, setup)
    model = smp.DistributedModel(module)
    if setup.marks_after_wrapping:
        _mark(module, setup)
    rows = slice(smp.dp_rank() * BATCH // 2, (smp.dp_rank() + 1) * BATCH // 2)
    saved = 0

    def pack(tensor: Tensor) -> Tensor:
        nonlocal saved
        saved += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        losses = _train_steps(model, "cpu", rows)
    calls = {name: module.get_submodule(name).calls for name in BLOCKS}
    trained = Trained(losses, model.state_dict(), calls)
    smp.shutdown()
    return trained, saved


MISUSES = {
    "stranger before": "Linear that is not part of the model given to smp.DistributedModel",
    "after the first step": "called after the model's first step",
}


def _misuse(case: str) -> str:
    """What a mark the sharded model cannot honour raises."""
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0})
    module = _Net(Setup())
    stranger = torch.nn.Linear(2, 2)  # held: a mark is dropped with its module
    if case == "stranger before":
        smp.set_activation_checkpointing(stranger)
    model = smp.DistributedModel(module)
    train_step = _sum_step()
    try:
        train_step(model, torch.ones(2, 4))
        smp.set_activation_checkpointing(module.first)
    except ModelParallelError as exc:
        return str(exc)
    finally:
        smp.shutdown()
    return "nothing raised"


def _train_cases(cases: list[Case]) -> tuple[list[tuple[Trained, int]], list[str]]:
    """On every rank: each case trained in turn, then each misuse tried."""
    dist.init_process_group("gloo")
    results = [_train(case) for case in cases]
    messages = [_misuse(case) for case in MISUSES]
    dist.destroy_process_group()
    return results, messages


Ranks = list[tuple[list[tuple[Trained, int]], list[str]]]


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    return run_ranks(2, _train_cases, [*CASES.values(), *DROPOUT.values()], timeout=240)


@pytest.fixture(scope="module")
def trained(ranks: Ranks) -> dict[str, list[Trained]]:
    """Each case's result on each rank, by name."""
    return {name: [rank[0][i][0] for rank in ranks] for i, name in enumerate([*CASES, *DROPOUT])}


def test_checkpointed_regions_keep_fewer_activations(ranks: Ranks) -> None:
    """What the marks are for: every case that recomputes saves less for backward than the
    unmarked model (the same on both ranks), the whole model marked least of all. Not torch's
    reentrant checkpoint: its recomputation in backward saves through the same hooks again
    (for that region's backward only)."""
    counts = {name: {rank[0][i][1] for rank in ranks} for i, name in enumerate(CASES)}
    assert all(len(values) == 1 for values in counts.values()), counts
    saved = {name: values.pop() for name, values in counts.items()}
    for name, case in CASES.items():
        if case.recomputed and name != "torch reentrant":
            assert saved["whole model"] <= saved[name] < saved["nothing"], (name, saved)


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpointing_with_sharding_trains_like_one_process_and_recomputes(
    trained: dict[str, list[Trained]], name: str
) -> None:
    case = CASES[name]
    forwards = STEPS * case.setup.microbatches
    expected = {block: forwards * (2 if block in case.recomputed else 1) for block in BLOCKS}
    for rank, got in enumerate(trained[name]):
        assert_equivalent(got, reference(case.setup), f"{name}, rank {rank}")
        assert got.calls == expected, f"{name}, rank {rank}"


def test_dropout_in_a_checkpointed_module_draws_its_mask_again_when_preserved(
    trained: dict[str, list[Trained]],
) -> None:
    """With ``preserve_rng_state`` the recomputation draws the forward's mask again: training
    is that of the unmarked model; without it the mask differs, and so does training."""
    unmarked = trained["dropout unmarked"]
    for rank, (preserved, lost) in enumerate(
        zip(trained["dropout preserved"], trained["dropout not preserved"], strict=True)
    ):
        assert_equivalent(preserved, unmarked[rank], f"rank {rank}")
        assert preserved.calls["second"] == lost.calls["second"] == 2 * STEPS * 2
        weight = "second.fc1.weight"
        assert not torch.allclose(lost.params[weight], unmarked[rank].params[weight], atol=1e-4)


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_marks_the_sharded_model_cannot_honour_fail(ranks: Ranks, case: str) -> None:
    for _, messages in ranks:
        message = messages[list(MISUSES).index(case)]
        assert MISUSES[case] in message, message

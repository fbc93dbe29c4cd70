"""Tensor parallelism with the memory features, each against one process on the same global
batch. bf16 and fp16 parameters: tp=2 (and tp=2 x rdp=2 with the optimizer state sharded)
trains like one process running ``test_half_precision``'s recipe by hand (the model in half,
fp32 masters, here DTensors, stepped and rounded back; fp16's scale and an overflow on one
rank skipping the step on all; a partial checkpoint resumed; bf16 gradients accumulated over
two steps of a model moved once wrapped); ``smp.amp.GradScaler`` on DTensor gradients. Delayed
creation: each rank makes its shards with eager values. ``shard_optimizer_state`` at tp=2 x
rdp=2: ``test_tensor_equivalence``'s models train like one process."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

import dtrain.modelparallel as smp
from tests.modelparallel.api import test_half_precision as half
from tests.modelparallel.harness import run_ranks, single_process
from tests.modelparallel.tensor.test_equivalence import (
    CASES,
    STEPS,
    _batch,
    _lm,
    accumulated_norm,
    accumulated_reference,
    one_process,
    trained,
)

TP_LM = half.Case(
    _lm,
    (),
    lambda step: dict(zip(("ids", "mask"), _batch(step), strict=True)),
    lambda model, b: model((b["ids"], b["mask"], None, None, b["ids"]))[0],
)
"""The LM of ``test_tensor_equivalence`` as a case of ``test_half_precision``'s recipes (one
microbatch, ``dp`` the tp=2 model's data-parallel degree: 2 per replica)."""


def _reference(recipe: half.Recipe) -> dict[str, Any]:
    with single_process({}):  # smp.nn modules are created and run under smp
        return half.reference(recipe, TP_LM)


def _wrapped(recipe: half.Recipe) -> tuple[Any, Any]:
    with smp.delay_param_initialization(recipe.delayed):
        module = _lm()
    model = smp.DistributedModel(module)
    args: dict[str, Any] = {"static_loss_scale": recipe.static_loss_scale}
    if recipe.dynamic:
        args = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": args.popitem()[1]}}
    optimizer = torch.optim.SGD(model.parameters(), lr=half.LR, momentum=0.9)
    return model, smp.DistributedOptimizer(optimizer, **args)


def _train(recipe: half.Recipe, checkpoint: str | None) -> dict[str, Any]:
    """With ``checkpoint`` (a folder), a partial checkpoint is saved before the last step and
    a fresh model and optimizer resume from it."""
    config = {"tensor_parallel_degree": 2, "ddp": True, recipe.dtype: True}
    smp.init({**config, "shard_optimizer_state": recipe.shard_optimizer_state})
    model, optimizer = _wrapped(recipe)

    @smp.step
    def train_step(model: Any, batch: half.Batch, step: int) -> Tensor:
        loss = half._loss(recipe, step, TP_LM.loss(model, batch))
        model.backward(loss)
        return loss

    def poison(param: Tensor) -> None:
        param.grad.to_local().view(-1)[0] = math.inf

    losses, scales, norms = [], [], []
    for step in range(recipe.steps):
        if step == recipe.steps - 1 and checkpoint is not None:
            smp.save_checkpoint(checkpoint, "part", model=model, optimizer=optimizer)
            smp.reset()
            model, optimizer = _wrapped(recipe)
            smp.resume_from_checkpoint(checkpoint, tag="part")
        if step == recipe.poisoned_at and smp.rank() == 0:
            split = next(p for p in model.module.parameters() if isinstance(p, DTensor))
            hook = split.register_post_accumulate_grad_hook(poison)
        batch = half._rows(TP_LM.batch(step), smp.dp_rank(), smp.dp_size())
        optimizer.zero_grad()
        losses.append(float(train_step(model, batch, step).reduce_mean()))
        if step == recipe.poisoned_at and smp.rank() == 0:
            hook.remove()
        if recipe.clip is not None:
            norms.append(optimizer.clip_master_grads(recipe.clip))
        optimizer.step()
        scales.append(model.loss_scaling.loss_scale)
    saved = optimizer.state_dict()
    return {
        "losses": losses,
        "scales": scales,
        "norms": norms,
        "masters": saved["fp16_states"]["fp32_master_params"],
        "model": model.state_dict(),
        "stepped": {
            f"{type(p).__name__} {p.dtype}" for g in optimizer.param_groups for p in g["params"]
        },
        "half": {str(p.dtype) for p in model.parameters()},
        "dp_rank": smp.dp_rank(),
    }


# half.TOLERANCE holds here too: a row-split layer sums each rank's half partial product, and
# a scaled-batch gradient sums the tp group's batches in half, where one process rounds each
# replica's apart. Measured (lr 0.2): 5.6e-4 (bf16, three steps), 4.9e-5 (fp16, two steps
# taken), while a step moves the masters by about 2e-2.


def _check(results: list[dict[str, Any]], recipe: half.Recipe) -> None:
    expected = _reference(recipe)
    dtype = half.DTYPES[recipe.dtype]
    for got in results:
        want = [step[got["dp_rank"]] for step in expected["losses"]]
        assert got["losses"] == pytest.approx(want, rel=8 * torch.finfo(dtype).eps)
        assert got["scales"] == expected["scales"]
        assert got["norms"] == pytest.approx(expected["norms"], rel=1e-2)
        assert got["half"] == {str(dtype)}
        # fp32 masters, a DTensor for each split parameter (through a plain proxy sharing
        # its memory when ZeRO steps it).
        split = "Tensor" if recipe.shard_optimizer_state else "DTensor"
        assert got["stepped"] == {f"{split} torch.float32", "Parameter torch.float32"}
        for name, value in expected["masters"].items():
            master = got["masters"][name]
            torch.testing.assert_close(master, value, rtol=0, atol=half.TOLERANCE[recipe.dtype])
            assert torch.equal(got["model"][name], master.to(dtype)), name


def test_bf16_tensor_parallel_trains_like_one_process_with_fp32_dtensor_masters() -> None:
    # Created without memory: split when wrapped, the rest made at the first step, then half.
    recipe = half.Recipe("tp_lm", "bf16", microbatches=1, dp=2, clip=0.5, pp=1, delayed=True)
    ranks = run_ranks(2, _train_then_accumulate, recipe)
    _check(ranks, recipe)
    accumulated = accumulated_reference()
    for got in ranks:  # the masters' gradients, accumulated
        assert got["accumulated"] == pytest.approx(accumulated, rel=1e-2)


def _train_then_accumulate(recipe: half.Recipe) -> dict[str, Any]:
    """``_train``, then ``test_tensor_equivalence.accumulated_norm`` in half."""
    trained = _train(recipe, None)
    smp.reset()
    return {**trained, "accumulated": accumulated_norm()}


def test_fp16_tensor_parallel_with_sharded_state_skips_an_overflow_of_one_rank_on_all(
    tmp_path: Path,
) -> None:
    # tp=2 x rdp=2, the optimizer state sharded over the replicas (AWS's GPT-2 example's
    # combination). Step 1 overflows everywhere; at step 2 only rank 0's shard of one gradient
    # holds an inf: both steps are skipped on every rank, and each halves the dynamic scale.
    recipe = half.Recipe(
        "tp_lm", "fp16", steps=4, microbatches=1, dp=4, static_loss_scale=1024.0, dynamic=True,
        huge_loss_at=1, poisoned_at=2, pp=1, shard_optimizer_state=True,
    )  # fmt: skip
    _check(run_ranks(4, _train, recipe, str(tmp_path), timeout=120), recipe)
    # ZeRO shards over the rdp group: its files name the rdp rank (pp, tp, rdp)
    kinds = ("fp16_states", "optimizer")
    sharded = [f"{kind}_0_{tp}_{rdp}.pt" for kind in kinds for tp in (0, 1) for rdp in (0, 1)]
    files = sorted(p.name for p in (tmp_path / "part_partial").iterdir())
    assert files == sorted([*sharded, "model_0_0_0.pt", "model_0_1_0.pt"])


def _scaler_steps() -> dict[str, Any]:
    """Two steps under ``smp.amp.GradScaler``; after step 0's backward rank 0 alone writes an
    inf into its shard of a gradient."""
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    model = smp.DistributedModel(_lm())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=half.LR))
    scaler = smp.amp.GradScaler(init_scale=4.0)

    @smp.step
    def train_step(model: Any, batch: half.Batch) -> Tensor:
        loss = TP_LM.loss(model, batch)
        model.backward(scaler.scale(loss))
        return loss

    scales = []
    for step in range(2):
        optimizer.zero_grad()
        train_step(model, half._rows(TP_LM.batch(step), smp.dp_rank(), smp.dp_size()))
        if step == 0 and smp.rank() == 0:
            split = next(p for p in model.parameters() if isinstance(p, DTensor))
            split.grad.to_local().view(-1)[0] = math.inf
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"scales": scales, "model": model.state_dict()}


def _scaler_reference() -> dict[str, Any]:
    with single_process({}):
        model = _lm()
        optimizer = torch.optim.SGD(model.parameters(), lr=half.LR)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scales = []
        for step in range(2):
            optimizer.zero_grad()
            scaler.scale(TP_LM.loss(model, TP_LM.batch(step))).backward()
            if step == 0:
                next(iter(model.parameters())).grad.view(-1)[0] = math.inf
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return {"scales": scales, "model": model.state_dict()}


def test_grad_scaler_skips_an_overflow_in_one_rank_shard_on_both() -> None:
    expected = _scaler_reference()
    assert expected["scales"] == [2.0, 2.0]
    for got in run_ranks(2, _scaler_steps):
        assert got["scales"] == expected["scales"]
        for name, value in expected["model"].items():
            torch.testing.assert_close(got["model"][name], value, rtol=1e-4, atol=1e-6)


# --- delayed initialisation ---------------------------------------------------------------------


def _whole_split(model: Any) -> dict[str, Tensor]:
    """The whole values of the parameters split over the tp group (a gather; a replicated
    one's is its local tensor: copied)."""
    return {
        name: param.full_tensor().detach().clone()
        for name, param in model.module.named_parameters()
        if isinstance(param, DTensor)
    }


def _delayed(case: str) -> dict[str, Any]:
    """``case`` created eagerly at tp=2, then inside ``smp.model_creation`` without memory:
    the split parameters when each is wrapped; then the delayed one trained as
    ``test_tensor_equivalence`` trains the eager one."""
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "delayed_parameter_initialization": True})
    build, loss_fn = CASES[case]
    eager = build()
    if case == "mlp":
        smp.set_tensor_parallelism(eager)
    out: dict[str, Any] = {"eager": _whole_split(smp.DistributedModel(eager))}
    smp.reset()
    with smp.model_creation(tensor_parallelism=True):
        module = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = smp.DistributedModel(module)
    out["warnings"] = [str(w.message) for w in caught if "distributed" in str(w.message)]
    out["split"] = _whole_split(model)
    out["meta"] = sorted(n for n, p in model.module.named_parameters() if p.is_meta)
    out["losses"], _ = trained(model, loss_fn)
    out["trained"] = model.state_dict()
    smp.reset()
    with smp.model_creation(tensor_parallelism=True, dtype=torch.bfloat16):
        module = build()
    model = smp.DistributedModel(module)
    out["bf16"] = _whole_split(model)
    out["dtypes"] = {str(p.dtype) for p in model.parameters()}
    return out


UNMADE_WHEN_WRAPPED = {"lm": ["position_embedding.weight", "word_embedding.weight"], "mlp": []}
"""Parameters still without memory once the model is wrapped: those outside the distributed
modules (the LM's embeddings; the MLP's layers are all swapped, their originals made to be)."""


@pytest.mark.parametrize("case", ["lm", "mlp"])
def test_delayed_creation_makes_each_rank_shards_with_eager_values(case: str) -> None:
    build, _ = CASES[case]
    losses, params, _ = one_process(*CASES[case])
    with single_process({}):
        first = build().state_dict()
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            in_bf16 = build().state_dict()
        finally:
            torch.set_default_dtype(previous)
    ranks = run_ranks(2, _delayed, case, timeout=120)
    for got in ranks:
        # Split when wrapped, bit for bit as eager tp=2 and one process create them; the
        # rest of the model is still without memory.
        assert got["split"].keys() == got["eager"].keys() and got["split"]
        for name, value in got["split"].items():
            assert torch.equal(value, got["eager"][name]), name
            assert torch.equal(value, first[name]), name
            assert torch.equal(got["bf16"][name], in_bf16[name]), name
        assert got["meta"] == UNMADE_WHEN_WRAPPED[case]
        assert got["warnings"] == []  # seen as distributed before it is split
        assert got["dtypes"] == {"torch.bfloat16"}
        for name, value in params.items():
            torch.testing.assert_close(got["trained"][name], value, rtol=1e-4, atol=1e-6)
    mean = [sum(got["losses"][step] for got in ranks) / len(ranks) for step in range(STEPS)]
    assert mean == pytest.approx(losses, rel=1e-5)


# --- shard_optimizer_state ----------------------------------------------------------------------


def _sharded_state() -> dict[str, Any]:
    """Each case trained at tp=2 x rdp=2 with its optimizer state sharded over the rdp group:
    the losses, the whole model, the state elements this rank holds and the whole state's
    shapes."""
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "shard_optimizer_state": True})
    out: dict[str, Any] = {}
    for case, (build, loss_fn) in CASES.items():
        module = build()
        if case == "mlp":
            smp.set_tensor_parallelism(module)
        model = smp.DistributedModel(module)
        losses, optimizer = trained(model, loss_fn)
        held = optimizer.local_state_dict()["state"].values()
        whole = optimizer.state_dict()["state"]
        out[case] = {
            "losses": losses,
            "model": model.state_dict(),
            "held": sum(v["momentum_buffer"].numel() for v in held),
            "shapes": {name: tuple(v["momentum_buffer"].shape) for name, v in whole.items()},
            "local": sum(
                p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                for p in model.parameters()
            ),
        }
        smp.reset()
    return out


def test_shard_optimizer_state_with_tensor_parallelism_trains_like_one_process() -> None:
    ranks = run_ranks(4, _sharded_state, timeout=180)
    for case in CASES:
        losses, params, _ = one_process(*CASES[case])
        mean = [sum(r[case]["losses"][step] for r in ranks) / len(ranks) for step in range(STEPS)]
        assert mean == pytest.approx(losses, rel=1e-5), case
        # Whole momenta, one per parameter (the LM's head is tied to its word embedding).
        shapes = {n: tuple(v.shape) for n, v in params.items() if n != "lm_head.weight"}
        for got in ranks:
            assert got[case]["shapes"] == shapes
            for name, value in params.items():
                torch.testing.assert_close(got[case]["model"][name], value, rtol=1e-4, atol=1e-6)
        # The two replicas of a tp rank (ranks r and r + 2) share its momentum between them.
        for tp_rank in range(2):
            pair = [ranks[tp_rank][case], ranks[tp_rank + 2][case]]
            assert sum(got["held"] for got in pair) == pair[0]["local"], case
            assert max(got["held"] for got in pair) <= 0.55 * pair[0]["local"], case

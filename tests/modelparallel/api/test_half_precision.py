"""``fp16`` / ``bf16``: a half model, fp32 master weights, loss scaling, clipping, checkpoints.

Each pipelined run is compared with one process running the same recipe written out by hand: the
model in half, an fp32 copy of every parameter stepped by the optimizer and rounded back, the
half gradients of each microbatch accumulated by autograd, then (per data-parallel replica)
unscaled into fp32 and averaged.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.errors import ConfigError
from tests.modelparallel.harness import first_visible_gpu, run_ranks
from tests.modelparallel.hf_cases import HF_ENV
from tests.modelparallel.hf_cases import build as build_hf
from tests.modelparallel.models import ResidualTransformerLM

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LR = 0.1
Batch = dict[str, Tensor]


def _lm_batch(step: int) -> Batch:
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(100 + step))
    return {"ids": ids}


def _gpt2_batch(step: int) -> Batch:
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(200 + step))
    return {"input_ids": ids, "labels": ids}


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    split: tuple[str, ...]
    """Modules placed on partition 1."""
    batch: Callable[[int], Batch]
    loss: Callable[[nn.Module, Batch], Tensor]


CASES = {
    "lm": Case(
        lambda: ResidualTransformerLM(seed=0),
        ("blocks.2", "blocks.3", "ln_f"),
        _lm_batch,
        lambda model, b: model(b["ids"], labels=b["ids"])["loss"],
    ),
    "gpt2": Case(
        lambda: build_hf("gpt2"),
        ("transformer.h.2", "transformer.h.3", "transformer.ln_f"),
        _gpt2_batch,
        lambda model, b: model(**b)["loss"],
    ),
}


@dataclass(frozen=True)
class Recipe:
    case: str
    dtype: str
    steps: int = 3
    microbatches: int = 2
    dp: int = 1
    static_loss_scale: float = 1.0
    clip: float | None = None
    huge_loss_at: int | None = None
    """Step whose loss is multiplied by 1e30 (an fp16 overflow)."""
    dynamic: bool = False
    """A dynamic loss scale from ``static_loss_scale``: halved by each overflow (it would grow
    only after 1000 clean steps)."""
    poisoned_at: int | None = None
    """Step after whose backward ``poisoned_rank`` alone writes an inf into a gradient of its
    shard (sharded only): every rank must skip that optimizer step."""
    poisoned_rank: int = 0
    pp: int = 2
    """``pipeline_parallel_degree`` (1 with sharding)."""
    shard_optimizer_state: bool = False
    delayed: bool = False
    """Created inside ``smp.delay_param_initialization()``: each rank makes its own share."""
    sdp: int = 1
    """``sharded_data_parallel_degree``; above 1 there is no pipeline: the ``dp`` ranks shard
    the model in groups of ``sdp``, and ``optimizer.step()`` clips to ``clip``."""
    clip_master_grads: bool = False
    """Sharded: clip to ``clip`` by ``optimizer.clip_master_grads`` (``sdp_gradient_clipping``
    0), not in ``optimizer.step()``."""
    device: str = "cpu"
    """Where the reference computes: the ranks' device (theirs is the one ``smp.init`` picks)."""


def _rows(batch: Batch, index: int, parts: int) -> Batch:
    size = next(iter(batch.values())).shape[0] // parts
    return {k: v[index * size : (index + 1) * size] for k, v in batch.items()}


def _loss(recipe: Recipe, step: int, loss: Tensor) -> Tensor:
    return loss * 1e30 if step == recipe.huge_loss_at else loss


def reference(recipe: Recipe, case: Case | None = None) -> dict[str, Any]:
    """The recipe in one process (static loss scale only), on ``case`` (default: the
    recipe's)."""
    case = case or CASES[recipe.case]
    model = case.build().to(recipe.device)
    named = dict(model.named_parameters())
    masters = {n: nn.Parameter(p.detach().clone()) for n, p in named.items()}
    model.to(DTYPES[recipe.dtype])
    optimizer = torch.optim.SGD(masters.values(), lr=LR, momentum=0.9)
    scale = recipe.static_loss_scale
    losses, norms, scales = [], [], []
    for step in range(recipe.steps):
        batch = {key: value.to(recipe.device) for key, value in case.batch(step).items()}
        for master in masters.values():
            master.grad = None
        replica_losses = []
        for replica in range(recipe.dp):
            shard = _rows(batch, replica, recipe.dp)
            for param in named.values():
                param.grad = None
            parts = []
            for microbatch in range(recipe.microbatches):
                loss = _loss(
                    recipe,
                    step,
                    case.loss(model, _rows(shard, microbatch, recipe.microbatches)).float(),
                )
                loss.backward(torch.full_like(loss, scale / recipe.microbatches))
                parts.append(loss.item())
            replica_losses.append(sum(parts) / len(parts))
            for name, param in named.items():
                grad = param.grad.float() * (1.0 / scale)
                master = masters[name]
                master.grad = grad if master.grad is None else master.grad + grad
        for master in masters.values():
            master.grad /= recipe.dp
        if recipe.clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters.values(), recipe.clip)))
        finite = all(torch.isfinite(m.grad).all() for m in masters.values())
        if finite and step != recipe.poisoned_at:
            optimizer.step()
            with torch.no_grad():
                for name, param in named.items():
                    param.copy_(masters[name])
        elif recipe.dynamic:
            scale /= 2
        losses.append(replica_losses)
        scales.append(scale)
    return {
        "losses": losses,
        "scales": scales,
        "masters": {n: m.detach().cpu() for n, m in masters.items()},
        "model": {n: p.detach().cpu() for n, p in named.items()},
        "norms": norms,
    }


def _init(recipe: Recipe) -> None:
    config: dict[str, Any] = {
        "pipeline_parallel_degree": 1 if recipe.sdp > 1 else recipe.pp,
        "microbatches": recipe.microbatches,
        "auto_partition": False,
        "default_partition": 0,
        "ddp": recipe.dp > 1,
        "shard_optimizer_state": recipe.shard_optimizer_state,
    }
    if recipe.sdp > 1:
        config["sharded_data_parallel_degree"] = recipe.sdp
        config["sdp_param_persistence_threshold"] = 1000  # several units in the "lm" case
        by_step = recipe.clip is not None and not recipe.clip_master_grads
        config["sdp_gradient_clipping"] = recipe.clip if by_step else 0.0
    if recipe.dtype != "fp32":
        config[recipe.dtype] = True
    smp.init(config)


def _pipeline(recipe: Recipe, **optimizer_args: Any) -> tuple[Any, Any, Callable[[int], float]]:
    """The recipe's model and optimizer under smp, and one training step (returns its loss)."""
    case = CASES[recipe.case]
    with smp.delay_param_initialization(recipe.delayed):
        module = case.build()
    for name in case.split if recipe.pp > 1 and recipe.sdp == 1 else ():
        smp.set_partition(module.get_submodule(name), 1)
    model = smp.DistributedModel(module)
    if recipe.dynamic:
        scale = {"init_scale": recipe.static_loss_scale}
        optimizer_args = {"dynamic_loss_scale": True, "dynamic_loss_args": scale, **optimizer_args}
    optimizer = smp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        static_loss_scale=recipe.static_loss_scale,
        **optimizer_args,
    )

    @smp.step
    def train_step(model: smp.DistributedModel, batch: Batch, step: int) -> Tensor:
        loss = _loss(recipe, step, case.loss(model, batch))
        model.backward(loss)
        return loss

    def step(index: int) -> float:
        optimizer.zero_grad()
        batch = _rows(case.batch(index), smp.dp_rank(), smp.dp_size())
        loss = float(train_step(model, batch, index).reduce_mean())
        if index == recipe.poisoned_at and smp.rank() == recipe.poisoned_rank:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            grad.to_local()[0] = math.inf
        if recipe.clip is not None and (recipe.sdp == 1 or recipe.clip_master_grads):
            norms.append(optimizer.clip_master_grads(recipe.clip))
        optimizer.step()
        if recipe.sdp > 1:  # SMP's sharded optimizer's: the norm before clipping
            step_norms.append(optimizer._global_grad_norm)
        scales.append(model.loss_scaling.loss_scale if model.loss_scaling else 1.0)
        overflows.append(optimizer.overflow)
        return loss

    norms: list[float] = []
    step_norms: list[float] = []
    scales: list[float] = []
    overflows: list[bool] = []
    step.norms = norms  # type: ignore[attr-defined]
    step.step_norms = step_norms  # type: ignore[attr-defined]
    step.scales = scales  # type: ignore[attr-defined]
    step.overflows = overflows  # type: ignore[attr-defined]
    return model, optimizer, step


def _masters(optimizer: Any) -> dict[str, Tensor]:
    return optimizer.state_dict()["fp16_states"]["fp32_master_params"]


def _train(recipe: Recipe) -> dict[str, Any]:
    _init(recipe)
    model, optimizer, step = _pipeline(recipe)
    losses = [step(index) for index in range(recipe.steps)]
    local = dict(model.local_named_parameters())
    dtypes = {str(p.dtype) for p in local.values()}
    masters = _masters(optimizer)
    stepped = {str(p.dtype) for g in optimizer.param_groups for p in g["params"]}
    result = {
        "losses": losses,
        "masters": masters,
        "model": model.state_dict(),
        "dtypes": dtypes,
        "stepped": stepped,
        "norms": step.norms,
        "scales": step.scales,
        "state_elements": sum(
            value.numel()
            for values in optimizer.local_state_dict()["state"].values()
            for key, value in values.items()
            if key != "step"
        ),
        "local_bytes": sum(p.numel() * p.element_size() for p in local.values()),
        "master_bytes": sum(masters[n].numel() * 4 for n in local),
    }
    smp.shutdown()
    return result


TOLERANCE = {"bf16": 1e-3, "fp16": 2e-4}
"""How far a pipelined master may end from one process's. A half gradient summed in another order
(a value used on two partitions, microbatches accumulated) rounds differently: measured on the
"lm" case after 3 steps, 1.5e-4 (bf16) apart, while the steps move the masters by 2e-2 (a
wrong scale or a missing microbatch would be off by that much)."""


def _check(results: list[dict[str, Any]], recipe: Recipe) -> dict[str, Any]:
    expected = reference(recipe)
    atol = TOLERANCE[recipe.dtype]
    ulp = torch.finfo(DTYPES[recipe.dtype]).eps
    for rank, got in enumerate(results):
        replica = rank // recipe.pp
        want_losses = [step[replica] for step in expected["losses"]]
        assert got["losses"] == pytest.approx(want_losses, rel=2 * ulp)
        assert got["dtypes"] == {str(DTYPES[recipe.dtype])}
        assert got["stepped"] == {"torch.float32"}
        for name, value in expected["masters"].items():
            master = got["masters"][name]
            torch.testing.assert_close(master, value, rtol=0, atol=atol, msg=name)
            half = got["model"][name]
            assert half.dtype == DTYPES[recipe.dtype]
            # The model holds its masters rounded.
            assert torch.equal(half, master.to(half.dtype)), name
        assert got["norms"] == pytest.approx(expected["norms"], rel=1e-3)
        assert got["scales"] == expected["scales"]
    return expected


def test_bf16_pipeline_trains_like_one_process_with_fp32_masters() -> None:
    recipe = Recipe("lm", "bf16")
    results = run_ranks(2, _train, recipe)
    _check(results, recipe)
    # The masters keep what bf16 cannot hold.
    masters = results[0]["masters"].values()
    assert any((m != m.to(torch.bfloat16).float()).any() for m in masters)
    # 2 bytes per own parameter in the model, 4 in its master.
    for got in results:
        assert got["master_bytes"] == 2 * got["local_bytes"] > 0


@pytest.mark.gpu
def test_fp16_pipeline_on_one_gpu_trains_like_one_process_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both partitions on one GPU (a gloo world), fp16 parameters with a dynamic loss scale that
    one huge loss overflows (the step skipped on both ranks), fp32 masters."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())
    recipe = Recipe(
        "lm", "fp16", static_loss_scale=1024.0, dynamic=True, huge_loss_at=1, device="cuda"
    )
    _check(run_ranks(2, _train, recipe, timeout=180.0), recipe)


def test_bf16_delayed_initialisation_casts_each_rank_share_once_made() -> None:
    recipe = Recipe("lm", "bf16", steps=2, delayed=True)
    _check(run_ranks(2, _train, recipe), recipe)


def test_bf16_pipeline_with_data_parallel_replicas() -> None:
    recipe = Recipe("lm", "bf16", steps=2, dp=2)
    _check(run_ranks(4, _train, recipe, timeout=120.0), recipe)


def test_bf16_hugging_face_gpt2() -> None:
    recipe = Recipe("gpt2", "bf16", steps=2)
    _check(run_ranks(2, _train, recipe, env=HF_ENV), recipe)


def test_fp16_static_loss_scale_and_clipping() -> None:
    recipe = Recipe("lm", "fp16", static_loss_scale=1024.0, clip=0.5)
    results = _check(run_ranks(2, _train, recipe), recipe)
    assert all(norm > 0.5 for norm in results["norms"])  # clipping did happen


def test_fp16_with_shard_optimizer_state_skips_an_overflow_on_every_replica() -> None:
    # Each replica steps the masters whose state it holds (ZeRO) and broadcasts them; the
    # overflowing step 1 is skipped by both, before either steps its share.
    recipe = Recipe(
        "lm", "fp16", dp=2, pp=1, shard_optimizer_state=True, static_loss_scale=1024.0,
        dynamic=True, huge_loss_at=1,
    )  # fmt: skip
    results = run_ranks(2, _train, recipe)
    _check(results, recipe)
    whole = sum(p.numel() for p in CASES["lm"].build().parameters())  # one momentum each
    held = [got["state_elements"] for got in results]
    assert sum(held) == whole and max(held) < 0.65 * whole, held


def test_clip_master_grads_with_bf16() -> None:
    recipe = Recipe("lm", "bf16", steps=2, clip=0.1)
    _check(run_ranks(2, _train, recipe), recipe)


# --- sharded data parallelism: FSDP2's mixed precision ------------------------------------------


def _train_sharded(recipe: Recipe) -> dict[str, Any]:
    """The recipe on its ``dp`` ranks, sharded: the losses, the whole model's state, the
    tensors the optimizer steps, and the dtypes seen inside forward (a linear layer's input and
    weight, once FSDP2 has gathered it) and leaving the model."""
    _init(recipe)
    model, optimizer, step = _pipeline(recipe)
    inside: set[tuple[str, ...]] = set()
    leaving: set[str] = set()
    linear = next(m for m in model.module.modules() if isinstance(m, nn.Linear))
    linear.register_forward_pre_hook(
        lambda m, args: inside.add((str(args[0].dtype), str(m.weight.dtype)))
    )
    model.module.register_forward_hook(
        lambda m, args, out: leaving.update(str(out[key].dtype) for key in ("logits", "loss"))
    )
    losses = [step(index) for index in range(recipe.steps)]
    result = {
        "losses": losses,
        "scales": step.scales,
        "norms": step.norms,
        "step_norms": step.step_norms,
        "overflows": step.overflows,
        "model": model.state_dict(),
        "stepped": {
            f"{type(p).__name__} {p.dtype}" for g in optimizer.param_groups for p in g["params"]
        },
        "inside": inside,
        "leaving": leaving,
        "saved": sorted(optimizer.state_dict()),
    }
    smp.shutdown()
    return result


def _check_sharded(results: list[dict[str, Any]], recipe: Recipe) -> None:
    expected = reference(recipe)
    dtype = DTYPES[recipe.dtype]
    ulp = torch.finfo(dtype).eps
    skipped = [step in (recipe.huge_loss_at, recipe.poisoned_at) for step in range(recipe.steps)]
    norms = []  # clip_master_grads's: the norm over every shard, -1 when the step is skipped
    if recipe.clip_master_grads:
        norms = [-1.0 if skip else n for skip, n in zip(skipped, expected["norms"], strict=True)]
    step_norms, last = [], 0.0  # optimizer._global_grad_norm: unscaled, before any clipping
    for skip, norm in zip(skipped, expected["norms"], strict=False):  # measured with a clip
        last = last if skip else norm  # a skipped step leaves it
        step_norms.append(last)
    for rank, got in enumerate(results):
        assert got["losses"] == pytest.approx([s[rank] for s in expected["losses"]], rel=2 * ulp)
        assert got["scales"] == expected["scales"]
        assert got["overflows"] == (skipped if recipe.dtype == "fp16" else [False] * len(skipped))
        assert got["norms"] == pytest.approx(norms, rel=1e-3)  # as _check: fp16 sums' order
        if recipe.clip is not None:  # the reference measures it then
            assert got["step_norms"] == pytest.approx(step_norms, rel=1e-3)
        # The optimizer steps fp32 shards (the masters); forward computes in half and the
        # model's outputs leave in fp32; "fp16_states" holds fp16's loss scaler only: there
        # are no other masters.
        assert got["stepped"] == {"DTensor torch.float32"}
        assert got["inside"] == {(str(dtype),) * 2}
        assert got["leaving"] == {"torch.float32"}
        fp16_states = ["fp16_states"] if recipe.dtype == "fp16" else []
        assert got["saved"] == [*fp16_states, "param_groups", "state"]
        for name, value in expected["masters"].items():
            param = got["model"][name]
            assert param.dtype == torch.float32, name
            atol = TOLERANCE[recipe.dtype]
            torch.testing.assert_close(param, value, rtol=0, atol=atol, msg=name)


def test_bf16_sharded_trains_like_one_process_with_fp32_shards_as_masters() -> None:
    recipe = Recipe("lm", "bf16", dp=2, clip=0.5, sdp=2)
    _check_sharded(run_ranks(2, _train_sharded, recipe), recipe)


@pytest.mark.gpu
def test_bf16_sharded_on_one_gpu_trains_like_one_process_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FSDP2 over two ranks sharing one GPU (a gloo world): DTensor shards on the GPU,
    gathered in bf16, reduce-scattered in fp32, clipped by the optimizer's step."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())
    recipe = Recipe("lm", "bf16", dp=2, clip=0.5, sdp=2, device="cuda")
    _check_sharded(run_ranks(2, _train_sharded, recipe, timeout=180.0), recipe)


def test_bf16_hybrid_sharding_reduces_across_groups_in_fp32() -> None:
    recipe = Recipe("lm", "bf16", steps=2, dp=4, sdp=2)  # shard groups [0, 1] and [2, 3]
    _check_sharded(run_ranks(4, _train_sharded, recipe, timeout=120.0), recipe)


def test_bf16_sharded_hugging_face_gpt2_created_without_memory() -> None:
    recipe = Recipe("gpt2", "bf16", steps=2, dp=2, sdp=2, delayed=True)
    _check_sharded(run_ranks(2, _train_sharded, recipe, env=HF_ENV), recipe)


def test_fp16_sharded_trains_like_one_process_and_skips_overflows_on_every_rank() -> None:
    # Step 1's huge loss overflows every rank's fp16 gradients; at step 2 only rank 0's shard
    # holds an inf. Both steps are skipped on both ranks and each halves the dynamic scale;
    # steps 0 and 3 unscale, clip and step the fp32 shards as one process does. The clip is
    # below step 0's norm (0.72) and above step 3's (0.63): a gradient left scaled, or
    # clipped before it is unscaled, would be stepped wrongly in one of them.
    recipe = Recipe(
        "lm", "fp16", steps=4, dp=2, sdp=2, clip=0.68, static_loss_scale=1024.0, dynamic=True,
        huge_loss_at=1, poisoned_at=2,
    )  # fmt: skip
    _check_sharded(run_ranks(2, _train_sharded, recipe), recipe)


def test_fp16_hybrid_sharding_skips_an_overflow_in_another_group_and_clips_by_call() -> None:
    # Shard groups [0, 1] and [2, 3]: an inf in rank 3's shard at step 1 skips that step on
    # every rank of both groups and halves the scale everywhere alike. clip_master_grads
    # unscales before it clips: the clip lies between step 0's norm (0.72, left as it is) and
    # step 2's (0.76, clipped); a norm of scaled gradients would be 512 times larger.
    recipe = Recipe(
        "lm", "fp16", dp=4, sdp=2, clip=0.74, static_loss_scale=1024.0, dynamic=True,
        poisoned_at=1, poisoned_rank=3, clip_master_grads=True,
    )  # fmt: skip
    _check_sharded(run_ranks(4, _train_sharded, recipe, timeout=120.0), recipe)


class _Shifted(nn.Module):
    """A linear layer plus a floating buffer, called with a floating input; records the
    dtypes its forward sees (input, weight, buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("shift", torch.ones(4))
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        self.seen.append((x.dtype, self.linear.weight.dtype, self.shift.dtype))
        out = self.linear(x) + self.shift
        return {"out": out, "loss": out.square().mean()}


def _sharded_bit16() -> dict[str, Any]:
    smp.init({"ddp": True, "bf16": True, "sharded_data_parallel_degree": 2})
    module = _Shifted()
    module.linear.to(torch.bfloat16)  # created half: its masters are fp32 all the same
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: smp.DistributedModel, x: Tensor) -> dict[str, Tensor]:
        out = model(x)
        model.backward(out["loss"])
        return out

    out = train_step(model, torch.ones(2, 4))

    def whole_norm() -> float:
        grads = [p.grad.full_tensor().flatten() for p in model.parameters()]
        return float(torch.linalg.vector_norm(torch.cat(grads)))

    before = whole_norm()
    norm = optimizer.clip_master_grads(1e-3)
    result = {
        "seen": module.seen,
        "out": {k: v.outputs[0].dtype for k, v in out.items()},
        "state": {k: v.dtype for k, v in model.state_dict().items()},
        "params": {type(p).__name__ for p in model.parameters()},
        "norms": (before, norm, whole_norm()),
    }
    smp.shutdown()
    return result


def test_bf16_sharded_keeps_bit16_semantics() -> None:
    # Floating buffers bf16, floating inputs enter in bf16, outputs leave in fp32; the
    # parameters are fp32 shards, even those created in bf16; clip_master_grads returns the
    # norm of the whole gradients (each shard counted once) and clips them to its maximum.
    for got in run_ranks(2, _sharded_bit16):
        assert got["seen"] == [(torch.bfloat16,) * 3]
        assert got["out"] == {"out": torch.float32, "loss": torch.float32}
        assert got["state"] == {
            "linear.weight": torch.float32,
            "linear.bias": torch.float32,
            "shift": torch.bfloat16,
        }
        assert got["params"] == {"DTensor"}
        before, norm, after = got["norms"]
        assert norm == pytest.approx(before, rel=1e-6) and before > 1e-2
        assert after == pytest.approx(1e-3, rel=1e-4)


def _unscaled_once() -> dict[str, tuple[dict[str, Tensor], float]]:
    """fp16 sharded steps at a static scale of 1024 in one world, by the calls each makes:
    ``b`` a step body, ``c`` clip_master_grads (unscales), ``z`` zero_grad, ``s`` step; the
    state and the norm the step reports (``_global_grad_norm``)."""
    dist.init_process_group("gloo")
    results = {}
    for calls in ("bczbs", "bs", "bcbs", "bbs"):
        smp.init({"ddp": True, "fp16": True, "sharded_data_parallel_degree": 2})
        torch.manual_seed(0)
        model = smp.DistributedModel(_Shifted())
        optimizer = smp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR), static_loss_scale=1024.0
        )

        @smp.step
        def train_step(model: smp.DistributedModel, x: Tensor) -> None:
            model.backward(model(x)["loss"])

        x = torch.linspace(-1, 1, 8).reshape(2, 4)
        for call in calls:
            if call == "b":
                train_step(model, x)
            elif call == "c":
                optimizer.clip_master_grads(1e9)
            else:
                (optimizer.zero_grad if call == "z" else optimizer.step)()
        results[calls] = (model.state_dict(), float(optimizer._global_grad_norm))
        smp.shutdown()
    dist.destroy_process_group()
    return results


def test_fp16_sharded_gradients_unscaled_by_clipping_then_stepped() -> None:
    # Gradients dropped after clip_master_grads unscaled them leave the next body's scaled, for
    # optimizer.step() to unscale; a body after unscaling adds scaled gradients to them, so
    # they are scaled back first (weights 29.35 apart from two plain bodies without), and the
    # norm the step reports is that of the gradients it took, not the clip's earlier one.
    for results in run_ranks(2, _unscaled_once):
        for calls, straight in (("bczbs", "bs"), ("bcbs", "bbs")):
            state, norm = results[calls]
            for name, value in results[straight][0].items():
                assert torch.equal(state[name], value), (calls, name)
            assert norm == pytest.approx(results[straight][1], rel=1e-6), calls


def _dynamic() -> list[tuple[bool, float]]:
    recipe = Recipe("lm", "fp16", steps=5, huge_loss_at=2)
    _init(recipe)
    args = {"init_scale": 2.0**10, "scale_window": 2}
    model, optimizer, step = _pipeline(recipe, dynamic_loss_scale=True, dynamic_loss_args=args)
    history = []
    for index in range(recipe.steps):
        before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
        step(index)
        changed = any(not torch.equal(before[n], p) for n, p in model.local_named_parameters())
        assert optimizer.overflow is not changed  # SMP's flag: the step was skipped
        history.append((changed, model.half_precision.scaler.scale))
    smp.shutdown()
    return history


def test_dynamic_loss_scale_skips_overflowing_steps_on_every_rank() -> None:
    # The scale grows after every 2 clean steps; the huge loss of step 2 overflows the fp16
    # gradients: every rank (each with its own partition) skips that step, says so in
    # optimizer.overflow, and halves the scale.
    assert (
        run_ranks(2, _dynamic)
        == [[(True, 2.0**10), (True, 2.0**11), (False, 2.0**10), (True, 2.0**10), (True, 2.0**11)]]
        * 2
    )


def _resume(directory: str, sdp: int, partial: bool) -> dict[str, Any]:
    """Train 4 steps, saving after 2; then another model resumes from the save and trains the
    last 2 again. A full checkpoint holds the model only (as in SMP): the optimizer's full
    state, with the loss scaler, is saved and loaded apart, as a script does."""
    recipe = Recipe("lm", "fp16", steps=4, dp=sdp, sdp=sdp)
    args = {"init_scale": 2.0**12, "scale_window": 1}

    def masters(model: Any, optimizer: Any) -> dict[str, Tensor]:
        """A sharded model's masters are its parameters."""
        return model.state_dict() if sdp > 1 else _masters(optimizer)

    dist.init_process_group("gloo")  # one world for both runs
    _init(recipe)
    model, optimizer, step = _pipeline(recipe, dynamic_loss_scale=True, dynamic_loss_args=args)
    for index in range(2):
        step(index)
    optimizer_file = os.path.join(directory, "optimizer.pt")
    if partial:
        smp.save_checkpoint(directory, "mid", model=model, optimizer=optimizer)
    else:  # the optimizer's state first: the checkpoint's barriers then cover both
        smp.save(optimizer.state_dict(), optimizer_file, partial=False)
        smp.save_checkpoint(directory, "mid", partial=False, model=model)
    saved_scale = model.loss_scaling.scaler.scale
    straight = [step(index) for index in (2, 3)]
    want = masters(model, optimizer), model.loss_scaling.scaler.scale
    smp.shutdown()

    _init(recipe)
    model, optimizer, step = _pipeline(recipe, dynamic_loss_scale=True, dynamic_loss_args=args)
    with torch.no_grad():  # another model: everything must come from the checkpoint
        for param in model.parameters():
            param.add_(0.5)
    smp.resume_from_checkpoint(directory, "mid", partial=partial)
    if not partial:
        optimizer.load_state_dict(smp.load(optimizer_file, partial=False))
    states = [len(optimizer.local_state_dict()["state"])]
    resumed = [step(index) for index in (2, 3)]
    got = masters(model, optimizer), model.loss_scaling.scaler.scale
    files = sorted(os.listdir(os.path.join(directory, "mid_partial" if partial else "")))
    smp.shutdown()
    scales = [saved_scale]
    if sdp > 1 and partial:  # SMP's load_sharded_optimizer_state=False: the loss scaler only
        _init(recipe)
        model, optimizer, _ = _pipeline(recipe, dynamic_loss_scale=True, dynamic_loss_args=args)
        smp.resume_from_checkpoint(directory, "mid", load_sharded_optimizer_state=False)
        states.append(len(optimizer.local_state_dict()["state"]))
        scales.append(model.loss_scaling.scaler.scale)
        smp.shutdown()
    dist.destroy_process_group()
    return {
        "straight": straight,
        "resumed": resumed,
        "want": want,
        "got": got,
        "files": files,
        "states": states,
        "scales": scales,
    }


@pytest.mark.parametrize(
    ("sdp", "partial"), [(1, True), (2, True), (2, False)], ids=["pipeline", "sharded", "full"]
)
def test_checkpoint_resume_continues_exactly(sdp: int, partial: bool) -> None:
    # The scale grows after every step: only a resumed loss scaler gives the same steps.
    with tempfile.TemporaryDirectory() as directory:
        results = run_ranks(2, _resume, directory, sdp, partial)
    for result in results:
        assert result["resumed"] == result["straight"]
        assert result["got"][1] == result["want"][1] == 2.0**16
        for name, value in result["want"][0].items():
            assert torch.equal(result["got"][0][name], value), name
        saved = "fp16_states_0_0_0.pt" if partial else "optimizer.pt"
        assert saved in result["files"]
        assert result["states"][0] > 0  # the momentum buffers of the rank's parameters
    if sdp > 1 and partial:  # load_sharded_optimizer_state=False: the scale, no states
        for result in results:
            assert result["states"][1] == 0
            assert result["scales"][0] == result["scales"][1] != 2.0**12


def _bad_arguments() -> list[str]:
    smp.init({"pipeline_parallel_degree": 1})
    model = smp.DistributedModel(nn.Linear(2, 2))
    errors = []
    with pytest.raises(ConfigError) as info:
        smp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            dynamic_loss_scale=True,
            scale_windows=10,
        )
    errors.append(str(info.value))
    with pytest.raises(ConfigError) as info:
        smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), static_loss_scale=0)
    errors.append(str(info.value))
    smp.shutdown()
    return errors


def test_bad_arguments_are_named() -> None:
    keys, scale = run_ranks(1, _bad_arguments)[0]
    assert "dynamic_loss_args" in keys and "scale_window" in keys
    assert "static_loss_scale" in scale


def test_fp16_with_bf16_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"bf16: got True; allowed: only together with fp16=false"
    ):
        smp.init({"pipeline_parallel_degree": 1, "fp16": True, "bf16": True})


def test_dynamic_loss_args_defaults_and_hysteresis() -> None:
    from dtrain.modelparallel.api.precision import LossScaler

    scaler = LossScaler.of(None, True, {"delayed_shift": 2})
    assert scaler.scale == 2.0**32
    scaler.update(True)  # the first overflow only uses up the hysteresis
    assert scaler.scale == 2.0**32
    scaler.update(True)
    assert scaler.scale == 2.0**31
    assert math.isclose(LossScaler.of(None, False, {}).scale, 1.0)


def test_floating_inputs_enter_in_half_and_outputs_leave_in_fp32() -> None:
    from dtrain.modelparallel.api.precision import HalfParameters

    half = HalfParameters(torch.bfloat16, torch.device("cpu"), None)
    (x, ids, flag), kwargs = half.inputs(
        ((torch.ones(2), torch.arange(2), True), {"y": torch.ones(1)})
    )
    assert (x.dtype, ids.dtype, flag, kwargs["y"].dtype) == (
        torch.bfloat16,
        torch.int64,
        True,
        torch.bfloat16,
    )
    out = half.outputs({"logits": torch.ones(1, dtype=torch.bfloat16), "ids": torch.arange(1)})
    assert (out["logits"].dtype, out["ids"].dtype) == (torch.float32, torch.int64)


def test_a_later_step_adds_its_gradients_into_the_masters_in_place() -> None:
    """Accumulating over steps: a step's half gradients are added into the masters' fp32 ones,
    which ``average`` then sees whole, with no second fp32 buffer set aside."""
    from dtrain.modelparallel.api.precision import HalfParameters

    half = HalfParameters(torch.bfloat16, torch.device("cpu"), None)
    param = nn.Parameter(torch.ones(4))
    half.cast([param], [param])
    averaged: list[Tensor] = []
    for _ in range(2):
        param.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
        half.after_backward(lambda masters: averaged.extend(m.grad for m in masters))
    master = half.master(param)
    assert averaged[0] is averaged[1] is master.grad
    assert torch.equal(master.grad, torch.ones(4)) and param.grad is None

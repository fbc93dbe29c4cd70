"""Tensor-parallel training equals one process on the same global batch: tp=2 (world 2),
tp=2 x rdp=2 (world 4, two microbatches) and tp=2 x rdp=2 with prescaled_batch train
smp.nn.DistributedTransformerLMHead and a plain MLP marked with smp.set_tensor_parallelism (and
created on each rank with its own seed) to the one-process losses and parameters; in world 4
the LM is checkpointed (partial and whole) after three steps and resumed into a fresh model for
the fourth, and its whole checkpoint loads into the one-process model. The MLP's initial values
are broadcast once, when it is wrapped. At tp=2 in fp32,
optimizer.clip_master_grads clips as torch.nn.utils.clip_grad_norm_ does in one process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import dtrain.modelparallel as smp
from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from tests.modelparallel.harness import run_ranks, single_process

STEPS = 4
SAVED_AFTER = 3
GLOBAL_BATCH = 8
LR = 0.2
LM = {
    "num_layers": 2,
    "num_attention_heads": 4,
    "attention_head_size": 4,
    "hidden_size": 16,
    "intermediate_size": 32,
    "vocab_size": 32,
    "num_positions": 8,
    "attention_dropout_prob": 0.0,
    "hidden_dropout_prob": 0.0,
    "causal_mask_size": 8,
}


def _lm() -> nn.Module:
    return smp.nn.DistributedTransformerLMHead(**LM)


def _mlp() -> nn.Module:
    """Created with each rank's own seed, as AWS's scripts may seed (``seed + tp_rank``): its
    layers are swapped with rank 0's weights, those of one process."""
    torch.manual_seed(7 + smp.rank())
    return nn.Sequential(
        nn.Embedding(32, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Flatten()
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, 32, (GLOBAL_BATCH, 8), generator=g)
    mask = torch.ones(GLOBAL_BATCH, 8)
    mask[:, 7] = (torch.arange(GLOBAL_BATCH) % 2).float()  # some rows hide their last token
    return ids, mask


def _lm_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    loss, _ = model((ids, mask, None, None, ids))
    return loss


def _mlp_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(ids[:, :1]), mask)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor]]] = {
    "lm": (_lm, _lm_loss),
    "mlp": (_mlp, _mlp_loss),
}


def step_of(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """The ``@smp.step`` function of one training step with ``loss_fn``."""

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model, ids, mask)
        model.backward(loss)
        return loss

    return train_step


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def trained(
    model: Any,
    loss_fn: Callable[..., torch.Tensor],
    after_step: Callable[[], None] = lambda: None,
) -> tuple[list[float], Any]:
    """``model`` (wrapped) trained for STEPS steps on this rank's rows of each global batch
    (sharded by ``dp_rank``), calling ``after_step`` after each (to read its timeline); the
    losses and the optimizer."""
    optimizer = smp.DistributedOptimizer(_optimizer(model.parameters()))
    train_step = step_of(loss_fn)
    rows = GLOBAL_BATCH // smp.dp_size()
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    losses = []
    for step in range(STEPS):
        ids, mask = _batch(step)
        optimizer.zero_grad()
        losses.append(float(train_step(model, ids[mine], mask[mine]).reduce_mean()))
        optimizer.step()
        after_step()
    return losses, optimizer


def one_process(
    build: Callable[[], nn.Module], loss_fn: Callable[..., torch.Tensor]
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    """The losses, the final parameters and those after SAVED_AFTER steps."""
    with single_process({}):
        model = build()
        optimizer = _optimizer(model.parameters())
        losses, saved = [], {}
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = loss_fn(model, *_batch(step))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if step + 1 == SAVED_AFTER:
                saved = {k: v.clone() for k, v in model.state_dict().items()}
        return losses, model.state_dict(), saved


def _train(case: str, checkpoint: str | None) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """This rank's rows of each global batch, as SMP shards data: by dp_rank, or with
    prescaled_batch by rdp_rank (the tp group shares its rows). With ``checkpoint`` (a folder)
    the model is saved after SAVED_AFTER steps and a fresh one resumes from it."""
    build, loss_fn = CASES[case]
    model, optimizer = _wrapped(case, build)
    train_step = step_of(loss_fn)
    prescaled = state.current().config["prescaled_batch"]
    rank, size = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
    rows = GLOBAL_BATCH // size
    mine = slice(rank * rows, (rank + 1) * rows)
    losses = []
    for step in range(STEPS):
        if step == SAVED_AFTER and checkpoint is not None:
            smp.save_checkpoint(checkpoint, "part", model=model, optimizer=optimizer)
            smp.save_checkpoint(checkpoint, "whole", partial=False, model=model)
            smp.reset()
            model, optimizer = _wrapped(case, build)
            smp.resume_from_checkpoint(checkpoint, tag="part")
        ids, mask = _batch(step)
        optimizer.zero_grad()
        losses.append(float(train_step(model, ids[mine], mask[mine]).reduce_mean()))
        optimizer.step()
    split = sum(isinstance(p, DTensor) for p in model.parameters())
    return losses, model.state_dict(), split


def _wrapped(case: str, build: Callable[[], nn.Module]) -> tuple[Any, Any]:
    module = build()
    if case == "mlp":
        smp.set_tensor_parallelism(module)
    model = smp.DistributedModel(module)
    return model, smp.DistributedOptimizer(_optimizer(model.parameters()))


def _broadcast_once() -> tuple[int, int]:
    """Elements broadcast while the MLP (created with each rank's own seed) is wrapped and
    steps once, and the MLP's own: every rank starts from rank 0's values, broadcast once (when
    wrapped, before the split), not again at the first step."""
    build, loss_fn = CASES["mlp"]
    module = build()
    own = sum(t.numel() for t in [*module.parameters(), *module.buffers()])
    counted: list[int] = []
    broadcast = dist.broadcast

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted.append(tensor.numel())
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = counting
    try:
        model, _ = _wrapped("mlp", lambda: module)
        ids, mask = _batch(0)
        rows = GLOBAL_BATCH // smp.dp_size()
        step_of(loss_fn)(model, ids[:rows], mask[:rows])
    finally:
        dist.broadcast = broadcast
    return sum(counted), own


def _on_ranks(microbatches: int, prescaled: bool, checkpoint: str | None) -> dict[str, Any]:
    smp.init(
        {
            "tensor_parallel_degree": 2,
            "ddp": True,
            "microbatches": microbatches,
            "prescaled_batch": prescaled,
        }
    )
    out: dict[str, Any] = {}
    for case in CASES:
        out[case] = _train(case, checkpoint if case == "lm" else None)
        smp.reset()
    out["broadcast"] = _broadcast_once()
    smp.reset()
    bad = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4))
    bad[1] = nn.Linear(5, 4)
    smp.set_tensor_parallelism(bad)
    try:
        smp.DistributedModel(bad)
    except ModelParallelError as exc:
        out["bad"] = str(exc)
    return out


@pytest.mark.parametrize(
    ("world", "microbatches", "prescaled"), [(2, 1, False), (4, 2, False), (4, 1, True)]
)
def test_tensor_parallel_training_equals_one_process(
    world: int, microbatches: int, prescaled: bool, tmp_path: Path
) -> None:
    checkpoint = str(tmp_path) if microbatches > 1 else None
    ranks = run_ranks(world, _on_ranks, microbatches, prescaled, checkpoint, timeout=180)
    for case in CASES:
        losses, params, saved = one_process(*CASES[case])
        if case == "lm" and checkpoint is not None:
            whole = torch.load(tmp_path / "whole")
            with single_process({}):
                _lm().load_state_dict(whole)  # strict: every key of the plain model
            for key, value in saved.items():
                torch.testing.assert_close(whole[key], value, rtol=1e-4, atol=1e-6)
        mean = [sum(rank[case][0][step] for rank in ranks) / world for step in range(STEPS)]
        assert mean == pytest.approx(losses, rel=1e-5), case
        for rank in ranks:
            trained, split = rank[case][1:]
            assert split == {"lm": 12 * LM["num_layers"], "mlp": 5}[case]
            assert trained.keys() == params.keys()
            for key, value in params.items():
                torch.testing.assert_close(trained[key], value, rtol=1e-4, atol=1e-6)
    for rank in ranks:
        counted, own = rank["broadcast"]
        assert counted == own
    assert ranks[0]["bad"] == (
        "smp.DistributedModel: module '1' (Linear) cannot be distributed: "
        "smp.nn.DistributedLinear: in_features=5 does not split over "
        "tensor_parallel_degree=2; allowed: a multiple of 2"
    )


CLIP = 0.05
"""Below every step's gradient norm of the LM: each step is clipped."""


def _clipped_step(model: Any, optimizer: Any, step: int) -> float:
    ids, mask = _batch(step)
    rows = GLOBAL_BATCH // smp.dp_size()
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    optimizer.zero_grad()
    step_of(_lm_loss)(model, ids[mine], mask[mine])
    norm = optimizer.clip_master_grads(CLIP)
    optimizer.step()
    return norm


def _clipped_fp32() -> tuple[list[float], dict[str, torch.Tensor], float]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    # moved before wrapping: torch swaps its DTensor parameters, which the model marks again
    model, optimizer = _wrapped("lm", lambda: _lm().to("cpu"))
    norms = [_clipped_step(model, optimizer, step) for step in range(2)]
    trained = model.state_dict()
    smp.reset()
    return norms, trained, accumulated_norm()


ACCUMULATED = 2
"""Steps whose gradients ``accumulated_norm`` adds up before one optimizer step."""


def accumulated_norm() -> float:
    """The MLP wrapped, then its inner module moved with ``to`` (torch swaps a DTensor
    parameter with its copy, the DistributedModel unaware), its gradients accumulated over
    ACCUMULATED steps: their norm. Averaging the earlier steps' again with a step's divided a
    split parameter's by the tp degree once more, and a mark lost in the move made them tp
    times too large."""
    build, loss_fn = CASES["mlp"]
    model, optimizer = _wrapped("mlp", build)
    model.get_module().to("cpu")
    rows = GLOBAL_BATCH // smp.dp_size()
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    for step in range(ACCUMULATED):
        ids, mask = _batch(step)
        step_of(loss_fn)(model, ids[mine], mask[mine])
    return optimizer.clip_master_grads(1e9)


def accumulated_reference() -> float:
    """``accumulated_norm`` of one process."""
    build, loss_fn = CASES["mlp"]
    with single_process({}):
        model = build()
        for step in range(ACCUMULATED):
            loss_fn(model, *_batch(step)).backward()
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))


@pytest.mark.parametrize(
    ("tp", "prescaled", "factor"), [(1, False, 1), (1, True, 1), (2, True, 1), (2, False, 2)]
)
def test_earlier_gradients_are_multiplied_only_where_their_average_divides_by_tp(
    tp: int, prescaled: bool, factor: int
) -> None:
    """Accumulating, an earlier step's gradient is averaged again with the next step's; only a
    split parameter's average divides by the tp degree (not at tp 1, nor prescaled, whose
    divisor is the number of batches the rdp group holds), so only its gradient is multiplied
    by it first, in place, and comes out of the average as it was: rdp ranks holding ``e``
    alike and ``n_r`` of their own give ``e + sum(n_r) / (rdp * tp)``."""
    from dtrain.modelparallel.tensor import averages

    rdp = 2
    st: Any = SimpleNamespace(tp_size=tp, rdp_size=rdp, config={"prescaled_batch": prescaled})
    assert averages.tp_batches(st) == factor
    params = [nn.Parameter(torch.zeros(3)) for _ in range(rdp)]
    for param in params:
        param.grad = torch.full((3,), 0.5)
        setattr(param, averages.SCALED_BATCH, True)
    earlier = [param.grad for param in params]
    memory = [grad.data_ptr() for grad in earlier]
    new = [torch.arange(3.0) + rank for rank in range(rdp)]
    for param in params:
        averages.carry_earlier([param], st)
    assert [param.grad.data_ptr() for param in params] == memory
    assert all(torch.equal(grad, torch.full((3,), 0.5 * factor)) for grad in earlier)
    averaged = sum(e + n for e, n in zip(earlier, new, strict=True)) / (rdp * factor)
    torch.testing.assert_close(averaged, 0.5 + sum(new) / (rdp * factor))


def test_fp32_tensor_parallel_clip_master_grads_clips_as_one_process() -> None:
    """Also for a model moved before wrapping, and gradients accumulated over two steps of a
    model moved once wrapped."""
    # torch.nn.utils.clip_grad_norm_ refuses the mix of tensors and DTensors.
    with single_process({}):
        model = _lm()
        optimizer = _optimizer(model.parameters())
        norms = []
        for step in range(2):
            optimizer.zero_grad()
            _lm_loss(model, *_batch(step)).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
        params = model.state_dict()
    assert min(norms) > CLIP
    accumulated = accumulated_reference()
    for got, trained, accumulated_got in run_ranks(2, _clipped_fp32):
        assert accumulated_got == pytest.approx(accumulated, rel=1e-5)
        assert got == pytest.approx(norms, rel=1e-5)
        for key, value in params.items():
            torch.testing.assert_close(trained[key], value, rtol=1e-4, atol=1e-6)

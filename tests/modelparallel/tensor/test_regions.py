"""The scaled-batch region at its edges: with dropout on (embeddings, attention probabilities,
hidden states) and layers checkpointed inside it, an LM head on two tensor-parallel ranks
trains to the losses and parameters of one process drawing from the same generator, with and
without prescaled_batch; ranks bringing batches of different shapes (with prescaled_batch,
different rows) fail naming them; a checkpointing mark on a swapped module moves to its
distributed module; a Hugging Face model split in place starts from rank 0's weights on ranks
seeded apart."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import activations
from tests.modelparallel.harness import first_visible_gpu, run_ranks, single_process
from tests.modelparallel.tensor.test_equivalence import LM as EQUIVALENCE_LM
from tests.modelparallel.tensor.test_hf import MODELS

STEPS = 2
GLOBAL_BATCH = 8
SEED = 3
LM = {**EQUIVALENCE_LM, "attention_dropout_prob": 0.3, "hidden_dropout_prob": 0.2}


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 32, (GLOBAL_BATCH, 8), generator=torch.Generator().manual_seed(step))


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def _one_process(device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    with single_process({}):
        torch.manual_seed(SEED)
        model = smp.nn.DistributedTransformerLMHead(**LM).to(device)
        optimizer = _optimizer(model.parameters())
        losses = []
        for step in range(STEPS):
            optimizer.zero_grad()
            ids = _batch(step).to(device)
            loss, _ = model((ids, None, None, None, ids))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses, {key: value.cpu() for key, value in model.state_dict().items()}


def _train(checkpointed: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """This rank's rows of each global batch (all of them with prescaled_batch: rdp is 1). The
    ranks' own generators differ; the group draws its masks from its first rank's."""
    torch.manual_seed(SEED + smp.rank())
    model = smp.DistributedModel(smp.nn.DistributedTransformerLMHead(**LM))
    layers = model.module.transformer.seq_layers
    # As SMP's GPT-2 script does, after wrapping: the Sequential (each layer) or one layer.
    smp.set_activation_checkpointing(layers if checkpointed == "layers" else layers[1])
    optimizer = smp.DistributedOptimizer(_optimizer(model.parameters()))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss, _ = model((ids, None, None, None, ids))
        model.backward(loss)
        return loss

    prescaled = smp.state.current().config["prescaled_batch"]
    rows = GLOBAL_BATCH // (1 if prescaled else smp.dp_size())
    rank = 0 if prescaled else smp.dp_rank()
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        ids = _batch(step)[rank * rows : (rank + 1) * rows]
        losses.append(float(train_step(model, ids).reduce_mean()))
        optimizer.step()
    return losses, model.state_dict()


def _mismatched() -> list[str]:
    """Rank 0 brings 4 rows, rank 1 brings 3, to a transformer layer and a DistributedLinear
    (positional and keyword input); then rank 0 alone brings a mask to the layer."""
    layer = smp.nn.DistributedTransformerLayer(
        num_attention_heads=2, attention_head_size=4, hidden_size=8, intermediate_size=16
    )
    linear = smp.nn.DistributedLinear(8, 4)
    rows = 4 - smp.tp_rank()
    errors = []
    for call in (
        lambda: layer((torch.zeros(rows, 5, 8), None)),
        lambda: linear(torch.zeros(rows, 8)),
        lambda: linear(input=torch.zeros(rows, 8)),
        lambda: layer((torch.zeros(4, 5, 8), torch.zeros(4, 1, 1, 5) if rows == 4 else None)),
    ):
        try:
            call()
        except ModelParallelError as exc:
            errors.append(str(exc))
    return errors


def _other_rows() -> list[str]:
    """With prescaled_batch, each rank brings rows of its own (sharded by dp_rank, not
    rdp_rank) of one shape, to a transformer layer and a DistributedLinear."""
    layer = smp.nn.DistributedTransformerLayer(
        num_attention_heads=2, attention_head_size=4, hidden_size=8, intermediate_size=16
    )
    linear = smp.nn.DistributedLinear(8, 4)
    rows = torch.arange(32.0).reshape(4, 8) + smp.dp_rank()
    errors = []
    for call in (lambda: layer((rows[:, None], None)), lambda: linear(rows)):
        try:
            call()
        except ModelParallelError as exc:
            errors.append(str(exc))
    return errors


def _in_place_seeded_apart() -> dict[str, torch.Tensor]:
    """A BERT created inside smp.tensor_parallelism() with each rank's own seed: its whole state
    dict once wrapped, before any step."""
    import transformers

    torch.manual_seed(100 + smp.rank())
    config = transformers.BertConfig(**MODELS["bert"].config)
    with smp.tensor_parallelism():
        model = transformers.BertForMaskedLM._from_config(config, attn_implementation="eager")
    return dict(smp.DistributedModel(model).state_dict())


def _swapped_mark() -> tuple[bool, float]:
    """A Linear marked for checkpointing, then swapped: its distributed module is checkpointed."""
    torch.manual_seed(SEED)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    smp.set_tensor_parallelism(module)
    smp.set_activation_checkpointing(module[0])
    model = smp.DistributedModel(module)
    marked = "0" in activations.kept_whole(model.module)

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    return marked, float(train_step(model, torch.ones(4, 8)).reduce_mean())


def _on_ranks(prescaled: bool) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
    out: dict[str, Any] = {}
    out["trained"] = _train("layer" if prescaled else "layers")
    smp.reset()
    if prescaled:
        out["errors"] = _other_rows()
        out["in place"] = _in_place_seeded_apart()
    else:
        out["errors"] = _mismatched()
        out["swapped"] = _swapped_mark()
    return out


def _trained_on_ranks() -> tuple[list[float], dict[str, torch.Tensor]]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    return _train("layers")


@pytest.mark.gpu
def test_a_tp_region_on_one_gpu_trains_as_one_process_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tp=2 on two ranks sharing one GPU (a gloo world: DTensor's and the region's collectives
    on GPU tensors), dropout drawn on the GPU from the group's seed, layers checkpointed."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())
    _assert_trained_as_one_process(run_ranks(2, _trained_on_ranks, timeout=180), "cuda")


def _assert_trained_as_one_process(
    ranks: list[tuple[list[float], dict[str, torch.Tensor]]], device: str, prescaled: bool = False
) -> None:
    """The parameters one process trains, on every rank; the losses of the ranks' rows average
    to one process's (with prescaled_batch each rank's is the whole batch's)."""
    losses, params = _one_process(device)
    for trained_losses, trained in ranks:
        if prescaled:
            assert trained_losses == pytest.approx(losses, rel=1e-5)
        for key, value in params.items():
            torch.testing.assert_close(trained[key], value, rtol=1e-4, atol=1e-6, msg=key)
    mean = [sum(rank[0][step] for rank in ranks) / 2 for step in range(STEPS)]
    assert mean == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("prescaled", [False, True])
def test_dropout_and_checkpointing_inside_the_region_train_as_one_process(
    prescaled: bool,
) -> None:
    ranks = run_ranks(2, _on_ranks, prescaled, timeout=180)
    _assert_trained_as_one_process([rank["trained"] for rank in ranks], "cpu", prescaled)
    if prescaled:
        rule = (
            "with prescaled_batch=True every rank of tensor-parallel group [0, 1] must bring the "
            "same batch, but rank(s) [1] bring other rows than rank 0: shard the data by "
            "smp.rdp_rank() over smp.rdp_size(), not by smp.dp_rank(); or modules before it "
            "computed different inputs on the tp ranks, e.g. dropout drawn from generators "
            "seeded apart: seed every rank of a tp group alike"
        )
        theirs = ranks[1]["in place"]  # rank 0's from the start: split layers and the rest
        assert all(torch.equal(value, theirs[key]) for key, value in ranks[0]["in place"].items())
        for rank in ranks:
            assert rank["errors"] == [
                f"smp.nn.{name}: {rule}"
                for name in ("DistributedTransformerLayer", "DistributedLinear")
            ]
        return
    group = "smp.nn.{}: the ranks of tensor-parallel group [0, 1] bring inputs of different shapes"
    rule = "with prescaled_batch=False every rank of a tp group must bring as many rows"
    assert ranks[0]["errors"] == ranks[1]["errors"]
    layer, linear, keyword, mask = ranks[0]["errors"]
    assert keyword == linear
    assert layer.startswith(group.format("DistributedTransformerLayer"))
    assert "rank 0 [4, 5, 8], rank 1 [3, 5, 8]; " + rule in layer
    assert linear.startswith(group.format("DistributedLinear"))
    assert "rank 0 [4, 8], rank 1 [3, 8]; " + rule in linear
    assert mask.startswith(
        "smp.nn.DistributedTransformerLayer: the ranks of tensor-parallel group [0, 1] bring "
        "different further inputs: rank 0: input 1 4 rows of torch.float32; rank 1: input 1 none"
    )
    with single_process({}):
        torch.manual_seed(SEED)
        plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        expected = plain(torch.ones(4, 8)).pow(2).mean().item()
    for rank in ranks:
        assert rank["swapped"] == (True, pytest.approx(expected, rel=1e-5))


def test_a_batch_on_the_meta_device_has_a_fingerprint_of_the_same_length() -> None:
    """The automatic partition's profiled forward of a model created without memory gives a
    region meta inputs (on every rank of the tp group alike): ``prescaled_batch``'s check row
    keeps its length, with nothing to compare."""
    from dtrain.modelparallel.tensor.batch import _fingerprint

    real = _fingerprint(torch.ones(4, 8))
    assert len(_fingerprint(torch.empty(4, 8, device="meta"))) == len(real) == 2
    assert _fingerprint(torch.empty(4, 8, device="meta")) == [0, 0]

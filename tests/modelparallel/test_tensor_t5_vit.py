"""Hugging Face T5 (encoder-decoder, relative position bias, tied LM head) and ViT (images)
split in place (``tensor/huggingface/t5.py``, ``vit.py``) train on two tensor-parallel ranks
like the plain HF model in one process: losses, and the whole parameters of ``state_dict()``,
which loads into the plain model unchanged, as the plain model's loads into the split one.
Tiny configs (2 layers, width 32, 4 heads); one spawn trains every model.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.huggingface import inplace
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import run_ranks
from tests.modelparallel.models import seeded

pytest.importorskip("transformers")

STEPS = 3
TARGET = 6
"""Labelled tokens of every T5 row (the decoder's length)."""
T5 = {
    "vocab_size": hf_cases.VOCAB,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "dropout_rate": 0.0,
    "decoder_start_token_id": 0,
}
VIT = {
    "image_size": 8,
    "patch_size": 4,
    "num_channels": 3,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "num_labels": 5,
}


def _t5_batch(step: int) -> hf_cases.Batch:
    """hf_cases' padded rows as the encoder's input, ``TARGET`` labelled tokens a row."""
    batch = hf_cases.CASES["gpt2"].batch(step)
    g = torch.Generator().manual_seed(3000 + step)
    labels = torch.randint(1, hf_cases.VOCAB, (hf_cases.GLOBAL_BATCH, TARGET), generator=g)
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels,
    }


def _vit_batch(step: int) -> hf_cases.Batch:
    g = torch.Generator().manual_seed(4000 + step)
    pixels = torch.randn(hf_cases.GLOBAL_BATCH, 3, 8, 8, generator=g)
    return {
        "pixel_values": pixels,
        "labels": torch.randint(0, 5, (hf_cases.GLOBAL_BATCH,), generator=g),
    }


@dataclass(frozen=True)
class Model:
    kind: str
    """``transformers``' prefix: ``<kind>Config`` and ``<kind><head>``."""
    head: str
    config: dict[str, Any]
    batches: Any
    inside: bool = True
    """Made inside ``smp.tensor_parallelism()``, else marked by ``smp.set_tensor_parallelism``."""

    def build(self, **changes: Any) -> nn.Module:
        import transformers

        config = getattr(transformers, f"{self.kind}Config")(**{**self.config, **changes})
        kind = getattr(transformers, f"{self.kind}{self.head}")
        return seeded(0, lambda: kind._from_config(config, attn_implementation="eager")).train()


MODELS = {
    "t5": Model("T5", "ForConditionalGeneration", T5, _t5_batch),
    "t5_gated": Model(
        "T5",
        "ForConditionalGeneration",
        {**T5, "feed_forward_proj": "gated-gelu"},
        _t5_batch,
        inside=False,
    ),
    "vit": Model("ViT", "ForImageClassification", VIT, _vit_batch),
}

SPLIT = {"t5": 34, "t5_gated": 38, "vit": 24}
"""Parameters held as DTensors. T5's encoder block: q, k, v, o, wi, wo (gated: wi_0, wi_1);
the decoder's: the same and the cross attention's q, k, v, o; each first block the relative
position bias. ViT's layer: the weights and biases of q, k, v, o, fc1, fc2."""


def _plain(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    spec = MODELS[name]
    model = spec.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=hf_cases.LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(**spec.batches(step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train(name: str) -> dict[str, Any]:
    spec = MODELS[name]
    if spec.inside:
        with smp.tensor_parallelism():
            module = spec.build()
    else:
        module = spec.build()
        smp.set_tensor_parallelism(module)
    model = smp.DistributedModel(module)
    losses = hf_cases.train_wrapped(model, spec.batches, STEPS)
    split = sum(isinstance(p, DTensor) for p in model.parameters())
    trained = {key: value.clone() for key, value in model.state_dict().items()}
    model.load_state_dict(spec.build().state_dict())  # the plain model's, back in
    return {"losses": losses, "state": trained, "split": split, "reloaded": model.state_dict()}


def _on_ranks() -> dict[str, Any]:
    dist.init_process_group("gloo")
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    out: dict[str, Any] = {}
    for name in MODELS:
        out[name] = _train(name)
        smp.reset()
    with smp.tensor_parallelism():
        bad = MODELS["t5"].build(num_heads=3)
    try:
        smp.DistributedModel(bad)
    except ModelParallelError as exc:
        out["bad"] = str(exc)
    smp.shutdown()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(2, _on_ranks, timeout=240, env=hf_cases.HF_ENV)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_on_two_tensor_parallel_ranks_as_one_process(
    ranks: list[dict[str, Any]], name: str
) -> None:
    losses, params = _plain(name)
    mean = [sum(rank[name]["losses"][step] for rank in ranks) / len(ranks) for step in range(STEPS)]
    assert mean == pytest.approx(losses, rel=1e-5)
    initial = MODELS[name].build().state_dict()
    for rank in ranks:
        assert rank[name]["split"] == SPLIT[name]
        state = rank[name]["state"]
        assert state.keys() == params.keys()
        for key, value in params.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6, msg=key)
        MODELS[name].build().load_state_dict(state)  # strict: HF's own keys
        for key, value in initial.items():
            assert torch.equal(rank[name]["reloaded"][key], value), key


def test_heads_that_do_not_split_fail_naming_them(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["bad"] == (
        "smp.DistributedModel: the model (T5ForConditionalGeneration) cannot be distributed: "
        "smp.nn.huggingface.t5: num_heads=3 does not split over tensor_parallel_degree=2; "
        "allowed: a multiple of 2"
    )


@pytest.mark.parametrize(
    ("family", "fields", "degree", "refused"),
    [
        ("t5", {}, 2, "dropout_rate=0.1"),  # T5's default: its attention drops with it too
        ("t5", {}, 1, None),
        ("t5", {"dropout_rate": 0.0}, 2, None),
        ("vit", {}, 2, None),  # ViT's default is 0
        ("vit", {"attention_probs_dropout_prob": 0.1}, 2, "attention_probs_dropout_prob=0.1"),
    ],
)
def test_attention_dropout_above_zero_is_refused_at_tp_above_one(
    family: str, fields: dict[str, Any], degree: int, refused: str | None
) -> None:
    import transformers

    config = getattr(transformers, f"{MODELS[family].kind}Config")(**fields)
    of = getattr(smp.nn.huggingface, family).FAMILY
    if refused is None:
        inplace.refuse_attention_dropout(config, of, degree)
    else:
        with pytest.raises(ModelParallelError, match=rf"config\.{refused} is not supported"):
            inplace.refuse_attention_dropout(config, of, degree)


@pytest.mark.parametrize(
    ("family", "hooks"),
    [("t5", "get_hf_t5_transformer_layer_hooks"), ("vit", "get_hf_vit_encoder_hooks")],
)
def test_smp_hooks_are_refused_naming_the_way_that_works(family: str, hooks: str) -> None:
    with pytest.raises(ModelParallelError, match=f"create the whole {MODELS[family].kind} model"):
        getattr(getattr(smp.nn.huggingface, family), hooks)()


IDS = torch.zeros(2, 4, dtype=torch.long)
PIXELS = torch.zeros(2, 3, 8, 8)


@pytest.mark.parametrize(
    ("family", "inputs", "error"),
    [
        ("t5", {"input_ids": IDS, "encoder_hidden_states": torch.zeros(2, 4, 32)}, None),
        ("t5", {"inputs_embeds": torch.zeros(2, 4, 32), "encoder_attention_mask": IDS}, None),
        ("t5", {"attention_mask": IDS}, "input_ids or inputs_embeds are required"),
        ("vit", {"pixel_values": PIXELS, "bool_masked_pos": IDS}, None),
        ("vit", {"attention_mask": IDS}, "pixel_values are required"),
        ("vit", {"pixel_values": PIXELS, "input_ids": IDS}, r"inputs \['input_ids'\]"),
    ],
)
def test_inputs_a_split_model_cannot_honour_are_refused(
    family: str, inputs: dict[str, Any], error: str | None
) -> None:
    spec = getattr(smp.nn.huggingface, family).FAMILY
    config = SimpleNamespace(output_attentions=False)
    if error is None:
        inplace._refuse_inputs(inputs, config, spec)
        return
    with pytest.raises(ModelParallelError, match=error):
        inplace._refuse_inputs(inputs, config, spec)

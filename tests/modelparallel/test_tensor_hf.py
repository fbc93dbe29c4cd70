"""Hugging Face models beyond GPT-2 split in place (``tensor/huggingface/inplace.py``) train on two
tensor-parallel ranks like the plain HF model in one process: losses, and the whole parameters
of ``state_dict()``, which loads into the plain model unchanged. Tiny configs (2 layers, hidden
32, 4 heads), hf_cases' batches (padded causal LM, masked LM); one spawn trains every model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import run_ranks
from tests.modelparallel.models import seeded

pytest.importorskip("transformers")

STEPS = 2
SIZES = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64}
CAUSAL = {"vocab_size": hf_cases.VOCAB, "max_position_embeddings": hf_cases.SEQ, **SIZES}


def _llama(kv_heads: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=2, num_key_value_heads=kv_heads, **CAUSAL)
    return LlamaForCausalLM._from_config(config, attn_implementation="eager")


def _gptneox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(num_hidden_layers=2, hidden_dropout=0.0, **CAUSAL)
    return GPTNeoXForCausalLM._from_config(config, attn_implementation="eager")


def _gptj() -> nn.Module:
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(
        vocab_size=hf_cases.VOCAB,
        n_positions=hf_cases.SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        rotary_dim=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPTJForCausalLM._from_config(config, attn_implementation="eager")


def _gptneo() -> nn.Module:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(
        vocab_size=hf_cases.VOCAB,
        max_position_embeddings=hf_cases.SEQ,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        resid_dropout=0.0,
        embed_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTNeoForCausalLM._from_config(config, attn_implementation="eager")


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **CAUSAL,
    )
    return BertForMaskedLM._from_config(config, attn_implementation="eager")


def _roberta() -> nn.Module:
    from transformers import RobertaConfig, RobertaForMaskedLM

    # Token 1 pads: RoBERTa's positions skip it, so the batches' ids exercise that rule.
    config = RobertaConfig(
        num_hidden_layers=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **{**CAUSAL, "max_position_embeddings": hf_cases.SEQ + 2},
    )
    return RobertaForMaskedLM._from_config(config, attn_implementation="eager")


MODELS: dict[str, tuple[Callable[[], nn.Module], str, bool]] = {
    "gptneox": (_gptneox, "gpt2", True),
    "llama": (_llama, "gpt2", True),
    "gptj": (_gptj, "gpt2", True),
    "bert": (_bert, "bert", True),
    "roberta": (_roberta, "bert", False),
    "gptneo": (_gptneo, "gpt2", False),
}
"""name → (builder, hf_cases batches, made inside ``smp.tensor_parallelism()`` rather than
marked with ``smp.set_tensor_parallelism``)."""


def _plain(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    build, batches, _ = MODELS[name]
    model = seeded(0, build)
    optimizer = torch.optim.SGD(model.parameters(), lr=hf_cases.LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(**hf_cases.CASES[batches].batch(step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train(name: str) -> dict[str, Any]:
    build, batches, inside = MODELS[name]
    if inside:
        with smp.tensor_parallelism():
            module = seeded(0, build)
    else:
        module = seeded(0, build)
        smp.set_tensor_parallelism(module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=hf_cases.LR))

    @smp.step
    def train_step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(**batch).loss
        model.backward(loss)
        return loss

    rows = hf_cases.GLOBAL_BATCH // smp.dp_size()
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    losses = []
    for step in range(STEPS):
        batch = {k: v[mine] for k, v in hf_cases.CASES[batches].batch(step).items()}
        optimizer.zero_grad()
        losses.append(float(train_step(model, batch).reduce_mean()))
        optimizer.step()
    split = sum(isinstance(p, DTensor) for p in model.parameters())
    return {"losses": losses, "state": model.state_dict(), "split": split}


def _on_ranks() -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    out: dict[str, Any] = {}
    for name in MODELS:
        out[name] = _train(name)
        smp.reset()
    with smp.tensor_parallelism():
        bad = _llama(kv_heads=1)
    try:
        smp.DistributedModel(bad)
    except ModelParallelError as exc:
        out["bad"] = str(exc)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(2, _on_ranks, timeout=240, env=hf_cases.HF_ENV)


SPLIT = {"gptneox": 16, "llama": 14, "gptj": 16, "bert": 24, "roberta": 24, "gptneo": 18}
"""Parameters held as DTensors: each split layer's weight, and its bias where it has one."""


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_trains_on_two_tensor_parallel_ranks_as_one_process(
    ranks: list[dict[str, Any]], name: str
) -> None:
    losses, params = _plain(name)
    mean = [(ranks[0][name]["losses"][s] + ranks[1][name]["losses"][s]) / 2 for s in range(STEPS)]
    assert mean == pytest.approx(losses, rel=1e-5)
    for rank in ranks:
        assert rank[name]["split"] == SPLIT[name]
        state = rank[name]["state"]
        seeded(0, MODELS[name][0]).load_state_dict(state)  # strict: HF's own keys
        for key, value in params.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6, msg=key)


def test_kv_heads_that_do_not_split_fail_naming_them(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["bad"] == (
        "smp.DistributedModel: the model (LlamaForCausalLM) cannot be distributed: "
        "smp.nn.huggingface.llama: num_key_value_heads=1 does not split over "
        "tensor_parallel_degree=2; allowed: a multiple of 2"
    )

"""Hugging Face GPT-2 created inside smp.tensor_parallelism() trains on two tensor-parallel
ranks like the plain HF model in one process, and its state dict translates to HF's and back."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

import dtrain.modelparallel as smp
from dtrain.modelparallel.tensor.huggingface.gpt2 import (
    translate_hf_state_dict_to_smdistributed,
    translate_state_dict_to_hf_gpt2,
)
from tests.modelparallel.harness import run_ranks

transformers = pytest.importorskip("transformers")

STEPS = 3
BATCH = 4
HF_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=4,
        vocab_size=32,
        n_positions=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(3)
    return transformers.GPT2LMHeadModel(config)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 32, (BATCH, 8), generator=torch.Generator().manual_seed(step))
    return ids, torch.ones(BATCH, 8, dtype=torch.long)


def _plain() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        ids, mask = _batch(step)
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _distributed() -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    with smp.tensor_parallelism():
        module = _gpt2()
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        model.backward(loss)
        return loss

    rows = BATCH // smp.dp_size()
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    losses = []
    for step in range(STEPS):
        ids, mask = _batch(step)
        optimizer.zero_grad()
        losses.append(float(train_step(model, ids[mine], mask[mine]).reduce_mean()))
        optimizer.step()
    return {"losses": losses, "state": model.state_dict(), "kind": type(model.module).__name__}


def test_gpt2_inside_tensor_parallelism_trains_as_the_plain_model() -> None:
    ranks = run_ranks(2, _distributed, timeout=180, env=HF_ENV)
    losses, params = _plain()
    assert ranks[0]["kind"] == "DistributedTransformerLMHead"
    mean = [(ranks[0]["losses"][s] + ranks[1]["losses"][s]) / 2 for s in range(STEPS)]
    assert mean == pytest.approx(losses, rel=1e-5)
    back = translate_state_dict_to_hf_gpt2(ranks[1]["state"])
    plain = _gpt2()
    plain.load_state_dict(back)  # strict: every key of the HF model
    for key, value in params.items():
        torch.testing.assert_close(back[key], value, rtol=1e-4, atol=1e-6, msg=key)
    again = translate_hf_state_dict_to_smdistributed(back)
    assert again.keys() == ranks[1]["state"].keys()
    for key, value in again.items():
        assert torch.equal(value, ranks[1]["state"][key]), key

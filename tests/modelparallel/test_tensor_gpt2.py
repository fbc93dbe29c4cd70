"""Hugging Face GPT-2 created inside smp.tensor_parallelism() trains on two tensor-parallel
ranks like the plain HF model in one process (hf_cases' tiny GPT-2 and padded batches), and its
state dict translates to HF's and back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtrain.modelparallel as smp
from dtrain.modelparallel.tensor.huggingface.gpt2 import (
    translate_hf_state_dict_to_smdistributed,
    translate_state_dict_to_hf_gpt2,
)
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import run_ranks

pytest.importorskip("transformers")

STEPS = 3


def _plain() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = hf_cases.build("gpt2")
    optimizer = torch.optim.SGD(model.parameters(), lr=hf_cases.LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(**hf_cases.CASES["gpt2"].batch(step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _distributed(delayed: bool) -> dict[str, Any]:
    """``delayed``: created without memory inside ``smp.model_creation``, as AWS's scripts do."""
    smp.init(
        {"tensor_parallel_degree": 2, "ddp": True, "delayed_parameter_initialization": delayed}
    )
    creation = smp.model_creation(tensor_parallelism=True) if delayed else smp.tensor_parallelism()
    with creation:
        module = hf_cases.build("gpt2")
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
        batch = {k: v[mine] for k, v in hf_cases.CASES["gpt2"].batch(step).items()}
        optimizer.zero_grad()
        losses.append(float(train_step(model, batch).reduce_mean()))
        optimizer.step()
    return {"losses": losses, "state": model.state_dict(), "kind": type(model.module).__name__}


@pytest.mark.parametrize("delayed", [False, True])
def test_gpt2_inside_tensor_parallelism_trains_as_the_plain_model(delayed: bool) -> None:
    ranks = run_ranks(2, _distributed, delayed, timeout=180, env=hf_cases.HF_ENV)
    losses, params = _plain()
    assert ranks[0]["kind"] == "DistributedTransformerLMHead"
    mean = [(ranks[0]["losses"][s] + ranks[1]["losses"][s]) / 2 for s in range(STEPS)]
    assert mean == pytest.approx(losses, rel=1e-5)
    back = translate_state_dict_to_hf_gpt2(ranks[1]["state"])
    hf_cases.build("gpt2").load_state_dict(back)  # strict: every key of the HF model
    for key, value in params.items():
        torch.testing.assert_close(back[key], value, rtol=1e-4, atol=1e-6, msg=key)
    again = translate_hf_state_dict_to_smdistributed(back)
    assert again.keys() == ranks[1]["state"].keys()
    for key, value in again.items():
        assert torch.equal(value, ranks[1]["state"][key]), key

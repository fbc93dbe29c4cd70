"""A Hugging Face model with its key/value cache on, trained with checkpointed layers: T5's
decoder appended each recomputed layer's keys to the cache a second time and failed (size 12
against 6); the cache is now off in training, as Hugging Face's gradient checkpointing has it."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import single_process

STEPS = 2


def _train(checkpointed: bool, **call: Any) -> tuple[list[float], list[str]]:
    """Losses of T5 (its config's ``use_cache`` on) over ``STEPS`` SGD steps in one process,
    2 microbatches, its decoder's blocks checkpointed or not; and the warnings given."""
    case = hf_cases.CASES["t5"]
    with single_process({"microbatches": 2}), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model: nn.Module = case.build()
        assert model.config.use_cache
        distributed = smp.DistributedModel(model)
        if checkpointed:
            smp.set_activation_checkpointing(model.decoder.block)
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(distributed.parameters(), lr=0.1))

        @smp.step
        def step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = model(**batch, **call).loss
            model.backward(loss)
            return loss

        losses = []
        for index in range(STEPS):
            optimizer.zero_grad()
            losses.append(float(step(distributed, case.batch(index)).reduce_mean()))
            optimizer.step()
    return losses, [str(w.message) for w in caught if "use_cache" in str(w.message)]


def test_checkpointed_t5_trains_with_its_cache_off_as_without_checkpointing() -> None:
    plain, quiet = _train(checkpointed=False)
    checkpointed, told = _train(checkpointed=True)
    assert checkpointed == pytest.approx(plain, rel=1e-6)
    assert quiet == []
    assert len(told) == 1 and "training with use_cache=False" in told[0]


def test_a_cache_asked_for_with_checkpointed_layers_is_refused_naming_the_way_out() -> None:
    with pytest.raises(ModelParallelError, match=r"use_cache=True\) with smp.set_activation_che"):
        _train(checkpointed=True, use_cache=True)

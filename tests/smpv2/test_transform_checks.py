"""``torch.sagemaker.transform`` (:mod:`dtrain.smpv2.transform`) in one process: at tp 1 nothing
is split but the layers become ``TransformerLayer`` instances for AWS's wrap policy, and what
dtrain does not build fails by name before anything changes. At tp 2 in
``test_transform.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.smpv2.layer import TransformerLayer
from dtrain.smpv2.transform import transform
from tests.smpv2.models import CASES, step

pytest.importorskip("transformers")


def test_at_tp_1_layers_become_transformer_layers_and_nothing_changes() -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    case = CASES["llama3"]
    logits, grads = step(case.build(seed=0), case)
    model = transform(case.build(seed=0), None)
    for layer in model.model.layers:
        assert isinstance(layer, TransformerLayer) and isinstance(layer, LlamaDecoderLayer)
        assert type(layer).__name__ == "LlamaDecoderLayer"
    got_logits, got_grads = step(model, case)
    torch.testing.assert_close(got_logits, logits, rtol=0, atol=0)
    assert got_grads.keys() == grads.keys()
    with pytest.raises(TypeError, match="is not built directly in dtrain"):
        TransformerLayer()


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"config": object()}, r"config=.* is not available yet in dtrain; pass config=None"),
        ({"cp_comm_type": "ring"}, r"cp_comm_type='ring'; allowed: p2p, all_gather"),
        ({"context_parallel_degree": 2}, r"context parallelism is not available yet"),
    ],
)
def test_what_is_not_built_is_refused(arguments: dict[str, Any], error: str) -> None:
    with pytest.raises(ModelParallelError, match=error):
        transform(CASES["mixtral"].build(seed=0), None, **arguments)


def test_other_models_and_a_second_transform_are_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ModelParallelError, match="GPT2LMHeadModel is not supported; supported"):
        transform(gpt2, None)
    model = transform(CASES["gptneox"].build(seed=0), None)
    with pytest.raises(ModelParallelError, match="the model is transformed already"):
        transform(model, None)


def test_dtype_and_device_place_the_parameters_only() -> None:
    model = transform(CASES["llama3"].build(seed=0), None, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32

"""Hugging Face GPT-NeoX marked with SMP's distributed-transformer intent (``zero_init=False``)
becomes a ``DistributedTransformerLMHead``: in one process each config option (rotary share,
parallel residual, tying, activation) gives HF's logits and loss, and the state dict
translates to HF's and back exactly; on two tensor-parallel ranks it trains as the plain HF
model. Without the intent the model is split in place, as before; what the translation cannot
honour is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import swap
from dtrain.modelparallel.tensor.attention import Rotary
from dtrain.modelparallel.tensor.huggingface.gptneox import (
    translate_hf_state_dict_to_smdistributed_gptneox,
    translate_state_dict_to_hf_gptneox,
)
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import run_ranks, single_process

pytest.importorskip("transformers")

STEPS = 3

OPTIONS: dict[str, dict[str, Any]] = {
    "parallel residual, a quarter rotary, untied": {},
    "sequential residual, whole rotary, tied, gelu_new": {
        "use_parallel_residual": False,
        "rotary_pct": 1.0,
        "rotary_emb_base": 500,
        "tie_word_embeddings": True,
        "hidden_act": "gelu_new",
    },
}


def _plain(**options: Any) -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=hf_cases.VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=hf_cases.SEQ,
        **options,
    )
    torch.manual_seed(0)
    return GPTNeoXForCausalLM._from_config(config, attn_implementation="eager").train()


def _swapped(**options: Any) -> tuple[Any, Any]:
    plain = _plain(**options)
    smp.set_tensor_parallelism(plain, zero_init=False)
    return plain, swap.distribute(plain)


@pytest.mark.parametrize("options", OPTIONS.values(), ids=list(OPTIONS))
def test_translated_gptneox_computes_as_hf_and_its_state_dict_translates_both_ways(
    options: dict[str, Any],
) -> None:
    batch = hf_cases.CASES["gpt2"].batch(0)  # padded rows, labels -100 on the padding
    with single_process({}):
        plain, dist = _swapped(**options)
        assert type(dist).__name__ == "DistributedTransformerLMHead"
        tied = dist.lm_head.weight is dist.word_embedding.weight
        assert tied == bool(options.get("tie_word_embeddings", False))
        expected, got = plain(**batch), dist(**batch)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.loss, expected.loss)
        mine = dist.state_dict()
    theirs = plain.state_dict()
    back = translate_state_dict_to_hf_gptneox(mine)
    assert back.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(back[key], value), key
    again = translate_hf_state_dict_to_smdistributed_gptneox(back)
    assert again.keys() == mine.keys()
    for key, value in again.items():
        assert torch.equal(value, mine[key]), key


def test_rotary_pairs_gpt_j_style_turn_neighbouring_dimensions() -> None:
    """Pairs (2i, 2i+1) turned by position p times base**(-2i/dim); dimensions past ``dim``
    kept: checked against complex multiplication."""
    x = torch.randn(1, 2, 5, 6)
    turned = Rotary("test", 4, 6, 100.0, halves=False)(x)
    pairs = torch.view_as_complex(x[..., :4].reshape(1, 2, 5, 2, 2).contiguous())
    angle = torch.arange(5.0)[:, None] * 100.0 ** (-torch.arange(0, 4, 2) / 4)
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    torch.testing.assert_close(turned[..., :4], expected)
    assert torch.equal(turned[..., 4:], x[..., 4:])


def test_without_the_intent_gptneox_is_split_in_place() -> None:
    with single_process({}):
        plain = _plain()
        smp.set_tensor_parallelism(plain, zero_init=True)
        assert swap.distribute(plain) is plain


def test_what_the_translation_cannot_honour_is_refused_by_name() -> None:
    ids = torch.zeros(2, 4, dtype=torch.long)
    with single_process({}):
        for options, message in (
            ({"attention_bias": False}, "attention_bias=False is not supported"),
            ({"hidden_act": "silu"}, "hidden_act='silu'; allowed: gelu, gelu_new, relu"),
            ({"rotary_pct": 0.1}, "rotary_dim=0; allowed: an even number from 2"),
        ):
            with pytest.raises((ModelParallelError, ValueError), match=message):
                _swapped(**options)
        _, dist = _swapped()
        with pytest.raises(ModelParallelError, match=r"does not take \['position_ids'\]"):
            dist(input_ids=ids, position_ids=ids)
        with pytest.raises(ModelParallelError, match=r"does not take \['use_cache'\]"):
            dist(input_ids=ids, use_cache=True)


def _train(options: dict[str, Any]) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    plain = _plain(**options)
    smp.set_tensor_parallelism(plain, zero_init=False)
    model = smp.DistributedModel(plain)
    losses = hf_cases.train_wrapped(model, "gpt2", STEPS)
    return {"losses": losses, "state": model.state_dict(), "kind": type(model.module).__name__}


def _reference(options: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _plain(**options)
    optimizer = torch.optim.SGD(model.parameters(), lr=hf_cases.LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(**hf_cases.CASES["gpt2"].batch(step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_translated_gptneox_trains_on_two_ranks_as_the_plain_model() -> None:
    options = OPTIONS["parallel residual, a quarter rotary, untied"]
    ranks = run_ranks(2, _train, options, timeout=180, env=hf_cases.HF_ENV)
    losses, params = _reference(options)
    assert ranks[0]["kind"] == "DistributedTransformerLMHead"
    mean = [(ranks[0]["losses"][s] + ranks[1]["losses"][s]) / 2 for s in range(STEPS)]
    assert mean == pytest.approx(losses, rel=1e-5)
    back = translate_state_dict_to_hf_gptneox(ranks[1]["state"], num_attention_heads=4)
    _plain(**options).load_state_dict(back)  # strict: every key of the HF model
    for key, value in params.items():
        torch.testing.assert_close(back[key], value, rtol=1e-4, atol=1e-6, msg=key)

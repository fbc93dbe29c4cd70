"""``smp.nn.FlashAttentionLayer`` (``tensor/flash.py``) computes the attention of packed
``qkv`` as the textbook formula does (scale, causal mask, SMP's ALiBi bias; values and
gradients), draws each head's dropout mask so that heads split over ranks draw what one process
draws, and refuses what it cannot honour. ``DistributedAttentionLayer`` computes with the same
per-head dropout (``flash.drop_heads``); its tp=2 equivalence is ``test_tensor_modules``' and
``test_tensor_regions``'. No processes."""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import dtrain.modelparallel as smp
from dtrain.compat import SHIM_ROOT
from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import modes
from dtrain.modelparallel.tensor.flash import drop_heads

BATCH, SEQ, HEADS, SIZE = 2, 5, 4, 8


def _qkv() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, SEQ, 3, HEADS, SIZE, generator=g, dtype=torch.float64)


def _reference(
    qkv: torch.Tensor, scale: float, causal: bool, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q kᵀ · scale + bias) v, head by head, position by position: ``[N, H, S, D]``."""
    out = torch.zeros(BATCH, HEADS, SEQ, SIZE, dtype=qkv.dtype)
    for n in range(BATCH):
        for h in range(HEADS):
            q, k, v = (qkv[n, :, i, h] for i in range(3))
            scores = q @ k.T * scale
            if bias is not None:
                scores = scores + bias.expand(BATCH, HEADS, SEQ, SEQ)[n, h]
            for i in range(SEQ):
                seen = i + 1 if causal else SEQ
                weights = torch.softmax(scores[i, :seen], dim=0)
                out[n, h, i] = weights @ v[:seen]
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("kwargs", "scale"),
    [
        ({"attention_head_size": SIZE}, SIZE**-0.5),
        ({"scale_attention_scores": False}, 1.0),
        (
            {"attention_head_size": SIZE, "scale_attn_by_layer_idx": True, "layer_idx": 2},
            1 / (math.sqrt(SIZE) * 3),
        ),
        ({"scale": 0.7, "scale_attn_by_layer_idx": True}, 0.7),  # a scale overrides the rest
    ],
)
def test_attention_is_the_formula(kwargs: dict[str, Any], scale: float, causal: bool) -> None:
    layer = smp.nn.FlashAttentionLayer(attention_dropout_prob=0.0, **kwargs)
    qkv = _qkv().requires_grad_()
    out = layer(qkv, causal=causal)
    expected_qkv = qkv.detach().clone().requires_grad_()
    expected = _reference(expected_qkv, scale, causal)
    torch.testing.assert_close(out, expected)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(qkv.grad, expected_qkv.grad)


def test_alibi_adds_the_mask_to_the_scores() -> None:
    layer = smp.nn.FlashAttentionLayer(
        attention_dropout_prob=0.0,
        attention_head_size=SIZE,
        triton_flash_attention=True,
        use_alibi=True,
    )
    slopes = torch.arange(1, HEADS + 1, dtype=torch.float64).view(1, HEADS, 1, 1)
    alibi = torch.arange(1 - SEQ, 1, dtype=torch.float64).view(1, 1, 1, SEQ) / slopes
    out = layer(_qkv(), attn_mask=alibi, causal=True)
    torch.testing.assert_close(out, _reference(_qkv(), SIZE**-0.5, True, alibi))


def test_evaluation_drops_nothing() -> None:
    layer = smp.nn.FlashAttentionLayer(attention_dropout_prob=0.5, attention_head_size=SIZE)
    torch.testing.assert_close(layer.eval()(_qkv()), _reference(_qkv(), SIZE**-0.5, False))


def test_drop_heads_numbered_from_a_ranks_first_draws_what_the_layer_draws_for_all() -> None:
    """Two ranks holding heads 0-1 and 2-3 of a layer, from one generator state (a region's),
    numbering them as ``DistributedAttentionLayer`` does, compute what the layer computes in one
    process for all four; the heads' masks differ."""
    layer = smp.nn.FlashAttentionLayer(attention_dropout_prob=0.5, attention_head_size=SIZE)
    query, key, value = _qkv().transpose(1, 3).unbind(2)
    torch.manual_seed(5)
    whole = layer.train()(_qkv())
    halves = []
    for first in (0, 2):
        torch.manual_seed(5)
        q, k, v = (t[:, first : first + 2] for t in (query, key, value))
        probs = (q @ k.transpose(-2, -1) * SIZE**-0.5).softmax(dim=-1)
        halves.append(drop_heads(probs, 0.5, first_head=first) @ v)
    torch.testing.assert_close(torch.cat(halves, dim=1), whole)
    assert not torch.allclose(whole, _reference(_qkv(), SIZE**-0.5, False))
    alike = _qkv()[:, :, :, :1].expand(-1, -1, -1, HEADS, -1)  # every head the same inputs
    out = layer(alike)
    assert not torch.allclose(out[:, 0], out[:, 2])  # rank 1's first head: not rank 0's mask


@pytest.mark.parametrize(
    ("degree", "training", "region", "refused"),
    [
        (2, True, True, True),
        (1, True, True, False),
        (2, False, True, False),
        (2, True, False, False),
    ],
)
def test_dropout_on_a_tp_ranks_share_of_heads_is_refused(
    monkeypatch: pytest.MonkeyPatch, degree: int, training: bool, region: bool, refused: bool
) -> None:
    """Given qkv, the layer cannot know which heads the rank holds: inside a tensor-parallel
    region at tp > 1 it would draw the masks of heads 0, 1, ... on every rank."""
    monkeypatch.setattr(state, "current", lambda what="": SimpleNamespace(tp_size=degree))
    layer = smp.nn.FlashAttentionLayer(attention_dropout_prob=0.5, attention_head_size=SIZE)
    with modes.tensor_region(region):
        if refused:
            with pytest.raises(ModelParallelError, match=r"FlashAttentionLayer: .*=0.5 in tr"):
                layer.train(training)(_qkv())
        else:
            layer.train(training)(_qkv())


@pytest.mark.parametrize(
    ("kwargs", "call", "error"),
    [
        ({}, {}, "scale_attention_scores=True needs attention_head_size"),
        (
            {"attention_head_size": SIZE, "scale_attn_by_layer_idx": True},
            {},
            "scale_attn_by_layer_idx=True needs layer_idx",
        ),
        (
            {"attention_head_size": SIZE, "triton_flash_attention": True},
            {},
            "triton_flash_attention=True has no attention dropout",
        ),
        ({"attention_head_size": SIZE, "use_alibi": True}, {}, "use_alibi=True needs triton"),
        ({"attention_head_size": SIZE}, {"attn_mask": torch.zeros(1)}, "attn_mask needs use_alibi"),
        ({"attention_head_size": SIZE}, {"qkv": torch.zeros(2, 5, 4, 8)}, "qkv must be"),
    ],
)
def test_what_it_cannot_honour_is_refused(
    kwargs: dict[str, Any], call: dict[str, Any], error: str
) -> None:
    with pytest.raises((ValueError, ModelParallelError), match=error):
        layer = smp.nn.FlashAttentionLayer(**kwargs)
        layer(**{"qkv": _qkv(), **call})


def test_smdistributed_names_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SHIM_ROOT))
    nn = importlib.import_module("smdistributed.modelparallel.torch.nn")
    assert nn.FlashAttentionLayer is smp.nn.FlashAttentionLayer
    for family in ("t5", "vit"):
        shim = importlib.import_module(f"smdistributed.modelparallel.torch.nn.huggingface.{family}")
        ours = getattr(smp.nn.huggingface, family)
        translate = f"translate_state_dict_to_hf_{family}"
        assert getattr(shim, translate) is getattr(ours, translate)
        assert getattr(shim, translate)({"a": 1}) == {"a": 1}  # HF's names are dtrain's

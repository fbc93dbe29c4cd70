"""``smp.nn.FlashAttentionLayer``: SMP's attention over packed query, key and value, on
``torch.nn.functional.scaled_dot_product_attention`` (which picks a flash kernel where it has
one), and :func:`drop_heads`, the per-head attention dropout every ``smp.nn`` attention
draws."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import modes


class FlashAttentionLayer(nn.Module):
    """SMP's ``FlashAttentionLayer``: softmax attention of packed ``qkv``, without parameters.

    The scale is ``scale`` when given; otherwise ``1/sqrt(attention_head_size)`` (with
    ``scale_attention_scores``, the default, which then needs ``attention_head_size``) times
    ``1/(layer_idx + 1)`` (with ``scale_attn_by_layer_idx``, which needs ``layer_idx``).
    ``attention_dropout_prob`` drops attention probabilities in training, each head with a mask
    of its own (:func:`drop_heads`), the heads it is given numbered from 0. Given ``qkv``, it
    cannot know which of a layer's heads a tp rank holds, so inside a tensor-parallel region at
    tp > 1 its dropout is refused (the ranks would repeat each other's masks, unlike one
    process; ``DistributedAttentionLayer`` numbers its share from its first head).
    ``triton_flash_attention`` chooses SMP's Triton kernel, which has no dropout: accepted (SDPA
    computes) with ``attention_dropout_prob=0`` only; with it, ``use_alibi`` lets ``forward``
    add ``attn_mask`` (SMP's ALiBi mask) to the scores.
    """

    def __init__(
        self,
        attention_dropout_prob: float = 0.1,
        attention_head_size: int | None = None,
        scale_attention_scores: bool = True,
        scale_attn_by_layer_idx: bool = False,
        layer_idx: int | None = None,
        scale: float | None = None,
        triton_flash_attention: bool = False,
        use_alibi: bool = False,
    ) -> None:
        super().__init__()
        what = "smp.nn.FlashAttentionLayer"
        if triton_flash_attention and attention_dropout_prob:
            raise ModelParallelError(
                f"{what}: triton_flash_attention=True has no attention dropout (SMP's Triton "
                f"kernel drops nothing), but attention_dropout_prob={attention_dropout_prob}; "
                "allowed: attention_dropout_prob=0"
            )
        if use_alibi and not triton_flash_attention:
            raise ValueError(
                f"{what}: use_alibi=True needs triton_flash_attention=True (SMP's ALiBi runs in "
                "its Triton kernel)"
            )
        self.attention_dropout_prob = attention_dropout_prob
        self.use_alibi = use_alibi
        self.scale = scale if scale is not None else 1.0
        if scale is None and scale_attention_scores:
            if attention_head_size is None:
                raise ValueError(
                    f"{what}: scale_attention_scores=True needs attention_head_size (or a "
                    "scale); allowed: the size of one head"
                )
            self.scale = attention_head_size**-0.5
        if scale is None and scale_attn_by_layer_idx:
            if layer_idx is None:
                raise ValueError(
                    f"{what}: scale_attn_by_layer_idx=True needs layer_idx (or a scale); "
                    "allowed: the layer's number, counted from 0"
                )
            self.scale /= layer_idx + 1

    def forward(
        self, qkv: torch.Tensor, attn_mask: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        """``qkv`` ``[batch, seq, 3, heads, head_size]`` → ``[batch, heads, seq, head_size]``
        (SMP's documented shapes). ``attn_mask``: an additive bias broadcastable to ``[batch,
        heads, seq, seq]`` (SMP's ALiBi mask), only with ``use_alibi``. ``causal``: each
        position attends to itself and the ones before it."""
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(
                "smp.nn.FlashAttentionLayer: qkv must be [batch, seq, 3, heads, head_size], got "
                f"{list(qkv.shape)}"
            )
        if attn_mask is not None and not self.use_alibi:
            raise ValueError(
                "smp.nn.FlashAttentionLayer: attn_mask needs use_alibi=True and "
                "triton_flash_attention=True (as SMP's); allowed without: None"
            )
        query, key, value = qkv.transpose(1, 3).unbind(2)  # each [batch, heads, seq, head_size]
        dropout = self.attention_dropout_prob if self.training else 0.0
        if dropout and modes.in_tensor_region():
            degree = state.current("smp.nn.FlashAttentionLayer").tp_size
            if degree > 1:
                raise ModelParallelError(
                    f"smp.nn.FlashAttentionLayer: attention_dropout_prob={dropout} in training "
                    f"inside a tensor-parallel region at tensor_parallel_degree {degree}: given "
                    "qkv, it cannot know which of the layer's heads the rank holds, so its masks "
                    "would differ from one process's; allowed: attention_dropout_prob=0 there, "
                    "or smp.nn.DistributedAttentionLayer (which numbers the rank's heads)"
                )
        return attend(query, key, value, attn_mask, self.scale, dropout, causal=causal)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    dropout: float,
    causal: bool = False,
) -> torch.Tensor:
    """Softmax attention of ``[batch, heads, seq, head_size]`` tensors with an additive
    ``bias``: SDPA without dropout; with it unfused, its masks drawn by :func:`drop_heads`."""
    if causal:
        length = query.shape[-2]
        allowed = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
        hidden = torch.zeros(length, length, dtype=query.dtype, device=query.device)
        hidden.masked_fill_(~allowed, float("-inf"))
        bias = hidden if bias is None else bias + hidden
    if bias is not None:
        bias = bias.to(query.dtype)
    if not dropout:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale)
    scores = query @ key.transpose(-2, -1) * scale
    probs = (scores if bias is None else scores + bias).softmax(dim=-1)
    return drop_heads(probs, dropout) @ value


def drop_heads(probs: torch.Tensor, dropout: float, first_head: int = 0) -> torch.Tensor:
    """Dropout on ``[batch, heads, query, key]`` attention probabilities, each head's mask drawn
    by a generator of its own, seeded with one draw from the current generator plus the head's
    number in its layer (``first_head`` numbers the first of ``probs``'): a tensor-parallel rank
    holding some of a layer's heads draws the masks one process draws for them (SDPA draws one
    mask for all the heads it is given, alike on every rank of a region's group)."""
    base = int(torch.randint(2**62, (1,), dtype=torch.int64).item())
    keep = torch.empty_like(probs)
    for head in range(probs.shape[1]):
        generator = torch.Generator(device=probs.device).manual_seed(base + first_head + head)
        keep[:, head].bernoulli_(1 - dropout, generator=generator)
    return probs * keep / (1 - dropout)

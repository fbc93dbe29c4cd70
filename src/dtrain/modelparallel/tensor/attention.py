"""``smp.nn.DistributedAttentionLayer``: self-attention with its heads split over the tp group."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dtrain.modelparallel import state
from dtrain.modelparallel.tensor import shards
from dtrain.modelparallel.tensor.batch import scaled_batch
from dtrain.modelparallel.tensor.flash import drop_heads
from dtrain.modelparallel.tensor.module import (
    UNSUPPORTED_EXTRAS,
    DistributedModule,
    check_speed_layout,
    init_linear,
    refuse_unsupported,
    seeded,
    split,
)

MASKED = -1e4
"""SMP's value for scores a mask hides (its ``mask_value``'s default)."""


class DistributedAttentionLayer(DistributedModule):
    """SMP's attention block: ``query``/``key``/``value`` projections split by heads (torch's
    ``ColwiseParallel``), attention over each rank's heads (``scaled_dot_product_attention``),
    the ``dense`` projection split by its input (``RowwiseParallel``: one all-reduce), dropout,
    the residual and a layer norm before (``pre_layernorm``) and/or after (``post_layernorm``).

    ``forward((hidden_states, attention_mask))``: hidden states ``[N, S, hidden_size]`` and an
    additive mask broadcastable to ``[N, 1, S, S]`` (SMP's ``[N, 1, 1, S]``, 0 where attended);
    returns the layer's output, ``[N, S, hidden_size]``. With ``causal_mask_size`` each
    position attends only to itself and earlier ones. Scores are scaled by
    ``1/sqrt(attention_head_size)`` (not with ``scale_attention_scores=False``) and with
    ``scale_attn_by_layer_idx`` by ``1/(layer_idx + 1)`` (``layer_idx`` 0 unless given, SMP's
    default), as SMP's ``FlashAttentionLayer`` and HF's GPT-2 do. Scores a causal mask hides
    get ``mask_value`` (SMP's, -1e4). With ``rotary_dim`` the first ``rotary_dim`` dimensions
    of every query and key head are rotated by their position (counted from 0) with base
    ``rotary_emb_base``: their halves against each other with ``gpt_neox_type_rotary``
    (GPT-NeoX's), neighbouring pairs otherwise (GPT-J's). ``use_qkv_bias`` and
    ``use_attn_dense_bias`` (SMP's names): the projections' biases. Cross attention is not
    implemented.

    In half precision (bf16 or fp16 activations) SMP's switches for its stability take effect:
    ``attention_in_fp32`` multiplies queries and keys in fp32; ``query_key_layer_scaling``
    divides the scores by the layer's number (``layer_idx + 1``; 1 without ``layer_idx``) as
    they are computed, keeping them in the half type's range, and multiplies them back in fp32
    (Megatron's trick: the probabilities are those without it). With either, the mask and the
    softmax run in fp32 and the probabilities return to the half type for the product with
    the values (attention then computed unfused). In fp32 neither changes anything.
    """

    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        cross_attention: bool = False,
        causal_mask_size: int | None = None,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        scale_attention_scores: bool = True,
        scale_attn_by_layer_idx: bool = False,
        layer_idx: int | None = None,
        rotary_dim: int | None = None,
        rotary_emb_base: float = 10000,
        gpt_neox_type_rotary: bool = False,
        use_qkv_bias: bool = True,
        use_attn_dense_bias: bool = True,
        attention_in_fp32: bool = False,
        query_key_layer_scaling: bool = False,
        mask_value: float = MASKED,
        **options: Any,
    ) -> None:
        super().__init__()
        refuse_unsupported(
            self.what,
            {"cross_attention": cross_attention, **options},
            {"cross_attention": False, **UNSUPPORTED_EXTRAS},
        )
        check_speed_layout(self.what)
        split(self.what, "num_attention_heads", num_attention_heads)
        self.attention_head_size = attention_head_size
        self.causal_mask_size = causal_mask_size
        self.attention_dropout_prob = attention_dropout_prob
        self.attention_in_fp32 = attention_in_fp32
        self.query_key_layer_scaling = query_key_layer_scaling
        self.mask_value = mask_value
        self.layer_number = (0 if layer_idx is None else layer_idx) + 1  # SMP's default: 0
        self.scale = attention_head_size**-0.5 if scale_attention_scores else 1.0
        if scale_attn_by_layer_idx:
            self.scale /= self.layer_number
        self.rotary: Rotary | None = None
        if rotary_dim is not None:
            self.rotary = Rotary(
                self.what, rotary_dim, attention_head_size, rotary_emb_base, gpt_neox_type_rotary
            )
        size = num_attention_heads * attention_head_size
        with seeded(self.what):
            self.query = nn.Linear(hidden_size, size, bias=use_qkv_bias)
            self.key = nn.Linear(hidden_size, size, bias=use_qkv_bias)
            self.value = nn.Linear(hidden_size, size, bias=use_qkv_bias)
            self.dense = nn.Linear(size, hidden_size, bias=use_attn_dense_bias)
            for layer in (self.query, self.key, self.value, self.dense):
                init_linear(layer, use_normal_initialization, initializer_range)
        self.pre_layernorm = nn.LayerNorm(hidden_size, layernorm_epsilon) if pre_layernorm else None
        self.layernorm = nn.LayerNorm(hidden_size, layernorm_epsilon) if post_layernorm else None
        self.dropout2 = nn.Dropout(hidden_dropout_prob)
        self.residual = True
        """False in a parallel layer, which adds the residual once to both blocks' sum (and
        then the block has no norm after)."""
        plan = {name: ColwiseParallel() for name in ("query", "key", "value")}
        shards.parallelize(self, {**plan, "dense": RowwiseParallel()}, self.what)

    def forward(self, inp: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        hidden_states, attention_mask = inp
        with scaled_batch(self.what, hidden_states, attention_mask) as batch:
            hidden = self.attend(batch.gather(hidden_states), batch.gather(attention_mask))
            return batch.scatter(hidden)

    def attend(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The layer on the tp group's combined batch (every rank its heads)."""
        inputs = hidden
        if self.pre_layernorm is not None:
            hidden = self.pre_layernorm(hidden)
        batch, length = hidden.shape[:2]
        projected = shards.shared_input(hidden, self.query)

        def heads(layer: nn.Linear) -> torch.Tensor:
            out = layer(projected)  # this rank's heads, side by side
            return out.view(batch, length, -1, self.attention_head_size).transpose(1, 2)

        bias = mask
        if self.causal_mask_size is not None:
            causal = torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()
            causal_bias = torch.zeros(length, length, dtype=hidden.dtype, device=hidden.device)
            causal_bias.masked_fill_(~causal, self.mask_value)
            bias = causal_bias if bias is None else bias + causal_bias
        if bias is not None:
            bias = bias.to(hidden.dtype)
        query, key, value = heads(self.query), heads(self.key), heads(self.value)
        if self.rotary is not None:
            query, key = self.rotary(query), self.rotary(key)
        dropping = self.training and self.attention_dropout_prob > 0
        wide = hidden.dtype in (torch.float16, torch.bfloat16) and (
            self.attention_in_fp32 or self.query_key_layer_scaling
        )
        if dropping or wide:
            probs = self.probabilities(query, key, bias, wide)
            context = (self._dropped_out(probs) if dropping else probs) @ value
        else:
            context = F.scaled_dot_product_attention(
                query, key, value, attn_mask=bias, scale=self.scale
            )
        context = context.transpose(1, 2).reshape(batch, length, -1)
        out = self.dropout2(self.dense(context))
        if not self.residual:
            return out
        out = out + inputs
        return out if self.layernorm is None else self.layernorm(out)

    def probabilities(
        self, query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor | None, wide: bool
    ) -> torch.Tensor:
        """The attention probabilities of ``[N, heads, S, head]`` queries and keys; ``wide``:
        as ``attention_in_fp32`` and ``query_key_layer_scaling`` ask, in fp32 (the class says
        how), returned in the queries' dtype."""
        if not wide:
            scores = query @ key.transpose(-2, -1) * self.scale
            return (scores if bias is None else scores + bias).softmax(dim=-1)
        dtype = query.dtype
        if self.attention_in_fp32:
            query, key = query.float(), key.float()
        coefficient = self.layer_number if self.query_key_layer_scaling else 1
        # Scaled before the product, so the product stays in range on every backend.
        scores = (query * (self.scale / coefficient)) @ key.transpose(-2, -1)
        scores = scores.float() * coefficient
        if bias is not None:
            scores = scores + bias.float()
        return scores.softmax(dim=-1).to(dtype)

    def _dropped_out(self, probs: torch.Tensor) -> torch.Tensor:
        """Dropout on the attention probabilities, each head's mask drawn by a generator of its
        own, seeded from the region's generator and the head's number in the whole layer: a
        rank draws the masks one process draws for the same heads (SDPA's dropout draws one
        mask for this rank's heads, alike on every rank of the group)."""
        first = state.current(self.what).tp_rank * probs.shape[1]
        return drop_heads(probs, self.attention_dropout_prob, first_head=first)


class Rotary:
    """Rotary position embeddings on the first ``dim`` dimensions of ``[N, heads, S, head]``
    queries or keys, position ``p`` turning dimension pair ``i`` by ``p / base**(2i / dim)``.
    ``halves``: pairs are dimensions ``i`` and ``i + dim/2`` (GPT-NeoX); otherwise ``2i`` and
    ``2i + 1`` (GPT-J)."""

    def __init__(self, what: str, dim: int, head_size: int, base: float, halves: bool) -> None:
        if dim <= 0 or dim % 2 or dim > head_size:
            raise ValueError(
                f"{what}: rotary_dim={dim}; allowed: an even number from 2 to "
                f"attention_head_size={head_size}"
            )
        self.dim = dim
        self.inverse = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.halves = halves

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-2], dtype=torch.float32, device=x.device)
        angles = positions[:, None] * self.inverse.to(x.device)[None]
        if self.halves:
            angles = torch.cat((angles, angles), dim=-1)
        else:
            angles = angles.repeat_interleave(2, dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        turned, kept = x[..., : self.dim], x[..., self.dim :]
        if self.halves:
            first, second = turned.chunk(2, dim=-1)
            partner = torch.cat((-second, first), dim=-1)
        else:
            partner = torch.stack((-turned[..., 1::2], turned[..., ::2]), dim=-1).flatten(-2)
        return torch.cat((turned * cos + partner * sin, kept), dim=-1)

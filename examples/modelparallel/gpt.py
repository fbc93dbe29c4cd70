"""A small GPT-2 style language model in plain PyTorch, to partition across a pipeline.

See how ``dtrain`` would split it (``sample_batch`` is found in the same file)::

    dtrain plan examples/modelparallel/gpt.py:build_model --partitions 2

``build_model`` returns the model (keyword arguments override :class:`GPTConfig`);
``sample_batch`` returns example inputs as ``(args, kwargs)``. With ``labels`` the model returns
the next-token cross-entropy loss, else the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    max_length: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 6
    dropout: float = 0.1


class SelfAttention(nn.Module):
    """Causal multi-head attention on PyTorch's fused kernel."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(dim, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4× MLP, each with a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.dim)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, 4 * config.dim),
            nn.GELU(),
            nn.Linear(4 * config.dim, config.dim),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, blocks, final norm, and a head tied to the embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.dim)
        self.wpe = nn.Embedding(config.max_length, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for embedding in (self.wte, self.wpe):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )


def build_model(**overrides: Any) -> GPT:
    """The model, seeded so every rank builds the same weights."""
    torch.manual_seed(0)
    return GPT(replace(GPTConfig(), **overrides))


def sample_batch(batch_size: int = 4, length: int = 64, vocab_size: int = 512) -> Any:
    """Random token ids as ``((input_ids,), {"labels": input_ids})``."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab_size, (batch_size, length), generator=generator)
    return (ids,), {"labels": ids}

"""Tiny reference models for the model-parallel tests, in plain PyTorch.

Each one exercises something a partitioner or a module-server runtime must survive:

* :class:`GroupedNet`: two submodules called in sequence (SMP's MNIST example).
* :class:`ResidualTransformerLM`: GPT-2 style LM with a tied embedding/head and a skip connection
  from the embedding output to the last block output, spanning any split of the blocks.
* :class:`BranchyNet`: a data-dependent branch, a submodule called twice, keyword arguments and
  tuple outputs.
* :class:`TiedEncoderDecoder`: T5's layout, one embedding weight used by the encoder's and the
  decoder's own embedding modules and by the LM head.
* :class:`SharedLayerLM`: ALBERT's layout, one transformer block applied to its own output
  ``layers`` times, and an LM head tied to the embedding.

Construction is deterministic for a given ``seed`` and leaves the global RNG untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

M = TypeVar("M", bound=nn.Module)


def seeded(seed: int, build: Callable[[], M]) -> M:
    """Build a module under a fixed seed without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class Features(nn.Module):
    """Convolution group (SMP MNIST's ``Net1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 8, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return torch.flatten(x, 1)


class Classifier(nn.Module):
    """Dense group (SMP MNIST's ``Net2``)."""

    def __init__(self, in_features: int, classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 32)
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x: Tensor) -> Tensor:
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


class GroupedNet(nn.Module):
    """Two groups called in sequence; input ``(batch, 1, 12, 12)``."""

    def __init__(self, seed: int = 0, classes: int = 10) -> None:
        super().__init__()

        def build() -> tuple[Features, Classifier]:
            return Features(), Classifier(8 * 4 * 4, classes)

        self.group1, self.group2 = seeded(seed, build)

    def forward(self, x: Tensor) -> Tensor:
        return self.group2(self.group1(x))


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention written with ``nn.Linear`` (no fused kernels)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        shape = (batch, length, self.heads, dim // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(dim // self.heads)
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ResidualTransformerLM(nn.Module):
    """GPT-2 style LM; ``lm_head`` shares its weight with ``wte`` unless ``tie_weights=False``.

    The embedding output is added to the last block's output: a skip connection spanning every
    split of the blocks, kept in the root's code (the runtime never sends it). ``forward``
    returns ``{"logits"}`` plus ``"loss"`` when labels are given (next-token cross entropy).
    """

    def __init__(
        self,
        seed: int = 0,
        vocab: int = 64,
        dim: int = 32,
        heads: int = 4,
        layers: int = 4,
        max_length: int = 16,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()

        def build() -> nn.ModuleDict:
            parts = nn.ModuleDict(
                {
                    "wte": nn.Embedding(vocab, dim),
                    "wpe": nn.Embedding(max_length, dim),
                    "blocks": nn.ModuleList(Block(dim, heads) for _ in range(layers)),
                    "ln_f": nn.LayerNorm(dim),
                    "lm_head": nn.Linear(dim, vocab, bias=False),
                }
            )
            for name in ("wte", "wpe"):
                nn.init.normal_(parts[name].weight, std=0.02)  # GPT-2's init: sane initial loss
            return parts

        parts = seeded(seed, build)
        self.wte = parts["wte"]
        self.wpe = parts["wpe"]
        self.blocks = parts["blocks"]
        self.ln_f = parts["ln_f"]
        self.lm_head = parts["lm_head"]
        if tie_weights:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x0 = self.wte(input_ids) + self.wpe(positions)
        h = x0
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.ln_f(h + x0))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
        return out


class Scale(nn.Module):
    """Elementwise affine map; :class:`BranchyNet` calls it twice."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class Pair(nn.Module):
    """Takes keyword arguments (a tensor and a float) and returns a tuple."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.left = nn.Linear(dim, dim)
        self.right = nn.Linear(dim, dim)

    def forward(
        self, x: Tensor, *, gate: Tensor | None = None, scale: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        if gate is not None:
            x = x * torch.sigmoid(gate)
        return self.left(x) * scale, torch.tanh(self.right(x))


class BranchyNet(nn.Module):
    """``positive`` runs when the input sums above zero, ``negative`` otherwise.

    ``shared`` is called twice; ``pair`` gets keyword arguments and returns a tuple; ``forward``
    returns a tuple ``(output, aux)``.
    """

    def __init__(self, seed: int = 0, dim: int = 8) -> None:
        super().__init__()

        def build() -> nn.ModuleDict:
            return nn.ModuleDict(
                {
                    "stem": nn.Linear(dim, dim),
                    "positive": nn.Sequential(nn.Linear(dim, dim), nn.Tanh()),
                    "negative": nn.Linear(dim, dim),
                    "shared": Scale(dim),
                    "pair": Pair(dim),
                    "head": nn.Linear(dim, 2),
                }
            )

        parts = seeded(seed, build)
        self.stem = parts["stem"]
        self.positive = parts["positive"]
        self.negative = parts["negative"]
        self.shared = parts["shared"]
        self.pair = parts["pair"]
        self.head = parts["head"]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.stem(x)
        h = self.positive(h) if x.sum() > 0 else self.negative(h)
        h = self.shared(h)
        a, b = self.pair(h, gate=x, scale=0.5)
        return self.head(self.shared(a + b)), b


class CrossAttention(nn.Module):
    """Attention from the decoder's positions to every position of the encoder's output."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        batch, length, dim = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, -1, self.heads, dim // self.heads).transpose(1, 2)

        k, v = self.kv(memory).split(dim, dim=2)
        scores = heads(self.q(x)) @ heads(k).transpose(-2, -1) / math.sqrt(dim // self.heads)
        out = scores.softmax(dim=-1) @ heads(v)
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class DecoderBlock(nn.Module):
    """T5's decoder block: causal self-attention, attention to the encoder, MLP (pre-norm)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.cross = CrossAttention(dim, heads)
        self.ln3 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.cross(self.ln2(x), memory)
        return x + self.mlp(self.ln3(x))


class Stack(nn.Module):
    """T5's encoder (``decoder=False``) or decoder: its own embedding module, blocks, final norm."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, decoder: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        kind = DecoderBlock if decoder else Block
        self.blocks = nn.ModuleList(kind(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, input_ids: Tensor, memory: Tensor | None = None) -> Tensor:
        h = self.embed_tokens(input_ids)
        for block in self.blocks:
            h = block(h) if memory is None else block(h, memory)
        return self.ln_f(h)


class TiedEncoderDecoder(nn.Module):
    """T5-like: ``shared`` holds the token embedding, which the encoder's and the decoder's
    ``embed_tokens`` and ``lm_head`` all use (one weight); ``shared`` itself never runs.

    The decoder reads the labels shifted right (token 0 first). ``forward`` returns
    ``{"logits"}`` plus ``"loss"`` when labels are given.
    """

    def __init__(
        self, seed: int = 0, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 3
    ) -> None:
        super().__init__()

        def build() -> nn.ModuleDict:
            parts = nn.ModuleDict(
                {
                    "shared": nn.Embedding(vocab, dim),
                    "encoder": Stack(vocab, dim, heads, layers, decoder=False),
                    "decoder": Stack(vocab, dim, heads, layers, decoder=True),
                    "lm_head": nn.Linear(dim, vocab, bias=False),
                }
            )
            nn.init.normal_(parts["shared"].weight, std=0.02)
            return parts

        parts = seeded(seed, build)
        self.shared = parts["shared"]
        self.encoder = parts["encoder"]
        self.decoder = parts["decoder"]
        self.lm_head = parts["lm_head"]
        for user in (self.encoder.embed_tokens, self.decoder.embed_tokens, self.lm_head):
            user.weight = self.shared.weight

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        memory = self.encoder(input_ids)
        targets = input_ids if labels is None else labels
        decoder_ids = F.pad(targets[:, :-1], (1, 0))
        logits = self.lm_head(self.decoder(decoder_ids, memory))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return out


class SharedLayerLM(nn.Module):
    """ALBERT-like: a small embedding mapped up to ``dim``, one block applied ``layers`` times
    (every layer shares its weights), and a head whose ``decoder`` is tied to the embedding.

    ``forward`` returns ``{"logits"}`` plus ``"loss"`` when labels are given (per token).
    """

    def __init__(
        self,
        seed: int = 0,
        vocab: int = 64,
        embedding: int = 16,
        dim: int = 32,
        heads: int = 4,
        layers: int = 4,
    ) -> None:
        super().__init__()
        self.layers = layers

        def build() -> nn.ModuleDict:
            parts = nn.ModuleDict(
                {
                    "embed": nn.Embedding(vocab, embedding),
                    "mapping_in": nn.Linear(embedding, dim),
                    "layer": Block(dim, heads),
                    "head": nn.Linear(dim, embedding),
                    "decoder": nn.Linear(embedding, vocab, bias=False),
                }
            )
            nn.init.normal_(parts["embed"].weight, std=0.02)
            return parts

        parts = seeded(seed, build)
        self.embed = parts["embed"]
        self.mapping_in = parts["mapping_in"]
        self.layer = parts["layer"]
        self.head = parts["head"]
        self.decoder = parts["decoder"]
        self.decoder.weight = self.embed.weight

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        h = self.mapping_in(self.embed(input_ids))
        for _ in range(self.layers):
            h = self.layer(h)
        logits = self.decoder(F.gelu(self.head(h)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return out

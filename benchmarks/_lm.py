"""The benchmarks' causal transformer LM, written as a user would: embeddings, a list of blocks,
a head that computes the loss. Also its two pipeline stages for ``torch.distributed.pipelining``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LMHead(nn.Module):
    """Final norm and vocabulary projection; ``forward`` returns the next-token loss."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(hidden))

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.logits(hidden), targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TransformerLM(nn.Module):
    """4 pre-norm encoder layers with a causal mask by default (machine-baselines §2's model)."""

    def __init__(
        self,
        vocab: int = 1024,
        d_model: int = 256,
        heads: int = 4,
        ff: int = 1024,
        layers: int = 4,
        seq: int = 128,
        seed: int = 0,
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, d_model)
            self.position = nn.Parameter(torch.zeros(seq, d_model))
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(layers)
            )
            self.head = LMHead(d_model, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position
        return self.head(run_blocks(self.blocks, h, self.mask), targets)


def run_blocks(blocks: nn.ModuleList, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        h = block(h, src_mask=mask, is_causal=True)
    return h


class FirstStage(nn.Module):
    """Embeddings and the first ``split`` blocks of ``model`` (shares its parameters)."""

    def __init__(self, model: TransformerLM, split: int) -> None:
        super().__init__()
        self.embed, self.position = model.embed, model.position
        self.blocks = nn.ModuleList(model.blocks[:split])
        self.mask = model.mask

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.blocks, self.embed(tokens) + self.position, self.mask)


class LastStage(nn.Module):
    """The blocks from ``split`` on and the head; returns logits (the schedule's loss_fn)."""

    def __init__(self, model: TransformerLM, split: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[split:])
        self.head = model.head
        self.mask = model.mask

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(run_blocks(self.blocks, hidden, self.mask))


class MiddleStage(nn.Module):
    """Blocks ``start`` to ``stop`` of ``model`` (shares its parameters): a stage of a split in
    more than two."""

    def __init__(self, model: TransformerLM, start: int, stop: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[start:stop])
        self.mask = model.mask

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.blocks, hidden, self.mask)

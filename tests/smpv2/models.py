"""Tiny Hugging Face models of the families ``torch.sagemaker.transform`` splits: 2 layers,
hidden 32, 4 heads, random weights, nothing downloaded. Llama comes as Llama 2 (as many
key/value heads as heads), Llama 3 (grouped queries, a padding row in the embedding) and Llama
3.1 (its rotary scaling) with tied embeddings (as Llama 3.2 has them); Mistral with a vocabulary
that does not split evenly; Mixtral with 4 experts, 2 per token; GPT-NeoX also with dropout on
its attention and hidden states."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tests.modelparallel import hf_cases

VOCAB = 64
SEQ = 8
ROWS = 2
HF_ENV = hf_cases.HF_ENV
"""The ranks' environment: offline and quiet, as importing ``hf_cases`` makes this process."""

SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 16,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


@dataclass(frozen=True)
class Case:
    kind: str
    """``transformers``' prefix: ``<kind>Config``, ``<kind>ForCausalLM``."""
    config: dict[str, Any] = field(default_factory=dict)
    attention: str = "sdpa"

    def build(self, seed: int | None = 0, meta: bool = False, **changes: Any) -> nn.Module:
        """The model created under ``seed`` (the caller's generator left as it was), from the
        caller's generator (``seed`` None), or on the meta device; ``changes`` to the config."""
        import transformers

        config = getattr(transformers, f"{self.kind}Config")(**{**SIZES, **self.config, **changes})
        kind = getattr(transformers, f"{self.kind}ForCausalLM")

        def create() -> nn.Module:
            return kind._from_config(config, attn_implementation=self.attention)

        if meta:
            with torch.device("meta"):
                return create()
        if seed is None:
            return create()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return create()


CASES = {
    "gptneox": Case("GPTNeoX"),
    "gptneox_dropout": Case("GPTNeoX", {"attention_dropout": 0.1, "hidden_dropout": 0.1}, "eager"),
    "llama2": Case("Llama", {"num_key_value_heads": 4}),
    "llama3": Case("Llama", {"num_key_value_heads": 2, "pad_token_id": 0}),
    "llama31_tied": Case(
        "Llama",
        {"num_key_value_heads": 2, "rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True},
    ),
    "mistral": Case("Mistral", {"num_key_value_heads": 2, "vocab_size": VOCAB + 1}),
    "mixtral": Case(
        "Mixtral", {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}
    ),
}

IDS = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))


def step(model: nn.Module, case: Case) -> tuple[Tensor, dict[str, Tensor]]:
    """One forward (under a fixed seed: its dropout draws alike everywhere) and backward of HF's
    own loss on :data:`IDS`: the logits and every parameter's whole gradient (a DTensor's
    gathered: every rank of its mesh calls this)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    grads = {name: whole(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def whole(tensor: Tensor) -> Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach()

"""What the translations of Hugging Face causal LMs into SMP's ``DistributedTransformerLMHead``
(GPT-NeoX, GPT-J) share: the model's config as the init hook's input, HF's keyword inputs
refused or passed on, the ``CausalLMOutputWithPast`` returned, layer counts of state dicts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.marks import Args


def args_of(model: nn.Module) -> Args:
    """The HF model's constructor arguments: its config."""
    return (model.config,), {}


def forward_inputs(
    what: str,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    return_dict: bool | None = None,
    logits_to_keep: int = 0,
    **others: Any,
) -> Args:
    """HF's keyword inputs → the LM head's input tuple; what it cannot honour is refused
    (``position_ids`` too: the rotary positions count from 0, as SMP's do)."""
    given = sorted(name for name, value in others.items() if value is not None)
    given += ["use_cache"] * bool(use_cache) + ["logits_to_keep"] * bool(logits_to_keep)
    if given:
        raise ModelParallelError(f"{what}: the distributed model does not take {given}")
    if return_dict is False:
        raise ModelParallelError(f"{what}: return_dict=False is not supported")
    return ((input_ids, attention_mask, None, None, labels),), {}


def output(outputs: Any) -> Any:
    """The LM head's ``logits`` or ``(loss, logits)`` as HF's ``CausalLMOutputWithPast``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    loss, logits = outputs if isinstance(outputs, tuple) else (None, outputs)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


def layer_count(state_dict: dict[str, Any], prefix: str) -> int:
    """The number of layers in a state dict whose layer keys start with ``prefix``."""
    depth = prefix.count(".")
    found = [int(key.split(".")[depth]) for key in state_dict if key.startswith(prefix)]
    return max(found, default=-1) + 1

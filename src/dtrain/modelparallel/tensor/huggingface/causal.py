"""What the translations of Hugging Face causal LMs into SMP's ``DistributedTransformerLMHead``
(GPT-NeoX, GPT-J) share: the model's config as the init hook's input, HF's keyword inputs
refused or passed on, the ``CausalLMOutputWithPast`` returned, state dicts renamed."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.marks import Args, Registration
from dtrain.modelparallel.tensor.transformer import DistributedTransformerLMHead


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


COMMON = {
    "use_normal_initialization": True,
    "pre_layernorm": True,
    "post_layernorm": True,
    "use_positional_embedding": False,
}
"""The LM head's arguments every rotary causal LM translates to: norms before each block and
the model's final norm as the last layer's after its output, no position table."""


def registration(what: str, init_hook: Any) -> Registration:
    """A family's registration: its init hook, the shared forward and return hooks (its
    weights are translated by its ``translations``)."""
    return Registration(
        DistributedTransformerLMHead,
        init_hook=init_hook,
        forward_hook=functools.partial(forward_inputs, what),
        return_hook=output,
    )


Translations = tuple[
    Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
]
"""A family's state-dict translations: to HF's names, and from them."""

Names = tuple[tuple[str, str], ...]
"""Module paths of one model and another's, ``{n}`` standing for a layer's number and
``{last}`` for the last layer's."""


def rename(
    what: str,
    state_dict: dict[str, torch.Tensor],
    names: Names,
    layers: str,
    skipped: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """``state_dict`` with each key's module path turned from a ``names`` pair's first form to
    its second (the parameter's own name kept); ``layers`` prefixes the layers' keys (so the
    last is known); paths ending in one of ``skipped`` are left out, others fail naming them."""
    last = str(layer_count(state_dict, layers) - 1)
    rules = []
    for source, target in names:
        pattern = re.escape(source).replace(r"\{n\}", r"(?P<n>\d+)").replace(r"\{last\}", last)
        rules.append((re.compile(rf"{pattern}\.(?P<kind>\w+)"), target.replace("{last}", last)))
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.rpartition(".")[0].endswith(skipped):
            continue
        for rule, target in rules:
            found = rule.fullmatch(key)
            if found:
                out[f"{target.format(**found.groupdict())}.{found['kind']}"] = value
                break
        else:
            raise ModelParallelError(f"{what}: unknown key {key!r}")
    return out


def hooks_of(registration: Registration) -> tuple[Any, Any, Any]:
    """SMP's ``get_hf_*_hooks()``: the init, forward and return hooks its registration of the
    model's class uses (what ``smp.tp_register_with_module`` takes after the classes)."""
    return registration.init_hook, registration.forward_hook, registration.return_hook

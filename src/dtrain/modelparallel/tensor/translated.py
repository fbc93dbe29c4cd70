"""Which modules of a model were translated from Hugging Face ones, and the model's full state
dict under HF's names and back (SMP's ``translate_if_full`` and automatic translation of full
checkpoints).

A Hugging Face model swapped for SMP's ``DistributedTransformerLMHead`` (:mod:`.swap`) has SMP's
parameter names, so its ``state_dict()`` does not load into the plain HF model, nor an HF state
dict (``from_pretrained(...).state_dict()``, as AWS's fine-tuning scripts save) into it. The swap
records each such module's translations here; a checkpoint then renames the keys under the
module's path either way and leaves the others. Imports no DTensor: checkpoints of models
without tensor parallelism ask too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain.modelparallel.errors import ModelParallelError

StateDict = dict[str, Any]


@dataclass(frozen=True)
class Translation:
    """How one swapped module's state dict becomes its Hugging Face original's and back."""

    source: str
    """The original's class name (for messages)."""
    to_hf: Callable[[StateDict], StateDict]
    from_hf: Callable[[StateDict], StateDict]


_recorded: weakref.WeakKeyDictionary[nn.Module, Translation] = weakref.WeakKeyDictionary()


def record(module: nn.Module, translation: Translation) -> None:
    """``module`` replaced a Hugging Face model that ``translation`` translates."""
    _recorded[module] = translation


def _translated(root: nn.Module) -> list[tuple[str, nn.Module, Translation]]:
    """``(path, module, translation)`` of each recorded module under ``root`` (never nested: a
    swapped module's submodules are its own)."""
    return [
        (path, module, _recorded[module])
        for path, module in root.named_modules()
        if module in _recorded
    ]


def named_state(
    root: nn.Module,
    persistent_only: bool = True,
    keep: Callable[[nn.Module], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_parameter)`` under every name ``root.state_dict()`` uses (a tied
    parameter under each of its names), of the modules ``keep`` admits, without computing the
    state dict (a DTensor's is a gather)."""
    for prefix, module in root.named_modules(remove_duplicate=False):
        if keep is not None and not keep(module):
            continue
        for key, param in module._parameters.items():
            if param is not None:
                yield (f"{prefix}.{key}" if prefix else key), param, True
        for key, buffer in module._buffers.items():
            if buffer is not None and not (
                persistent_only and key in module._non_persistent_buffers_set
            ):
                yield (f"{prefix}.{key}" if prefix else key), buffer, False


def state_keys(module: nn.Module) -> set[str]:
    """The keys of ``module.state_dict()``."""
    return {name for name, _, _ in named_state(module)}


def _under(path: str, state_dict: StateDict) -> tuple[StateDict, StateDict]:
    """``state_dict`` split into the keys under module ``path`` (the path taken off) and the
    others."""
    if not path:
        return dict(state_dict), {}
    start = f"{path}."
    inside = {k[len(start) :]: v for k, v in state_dict.items() if k.startswith(start)}
    return inside, {k: v for k, v in state_dict.items() if not k.startswith(start)}


def _prefixed(path: str, state_dict: StateDict) -> StateDict:
    return {f"{path}.{k}" if path else k: v for k, v in state_dict.items()}


def to_hf(root: nn.Module, state_dict: StateDict) -> StateDict:
    """``root``'s full state dict with each translated module's keys under its original's names:
    a model translated whole loads into the plain HF model."""
    for path, _, translation in _translated(root):
        inside, others = _under(path, state_dict)
        state_dict = others | _prefixed(path, translation.to_hf(inside))
    return state_dict


def from_hf(root: nn.Module, state_dict: StateDict) -> StateDict:
    """A full state dict for ``root`` whose translated modules' keys may be their HF originals'
    names: those are renamed. Keys mostly the module's own already stay, a stray one among them
    too (the load's strictness judges it, as torch's does)."""
    for path, module, translation in _translated(root):
        inside, others = _under(path, state_dict)
        own = state_keys(module)
        if len(set(inside) & own) >= len(set(inside) - own):  # SMP's names (or nothing) there
            continue
        try:
            renamed = translation.from_hf(inside)
        except ModelParallelError as exc:
            where = f"under {path!r}" if path else "of the model"
            raise ModelParallelError(
                f"the full state dict's keys {where} are neither the distributed module's nor "
                f"{translation.source}'s: {exc}; pass translate_function to translate them"
            ) from exc
        state_dict = others | _prefixed(path, renamed)
    return state_dict

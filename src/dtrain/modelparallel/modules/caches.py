"""Key/value caches in training with activation checkpointing.

A Hugging Face model with ``use_cache`` on gives each attention layer a cache object that its
forward appends the step's keys and values to. A checkpointed layer runs its forward again in
backward, appending them a second time: the recomputed attention then sees twice the keys
(T5's decoder fails with mismatched sizes; another model could compute on silently). Hugging
Face's own gradient checkpointing turns the cache off in training, with a warning; a model
whose layers ``smp.set_activation_checkpointing`` marked is given the same treatment here, and
a cache asked for explicitly is refused, naming the way out.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any

from torch import nn

from dtrain.modelparallel.errors import ModelParallelError

_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models told once that their cache is off."""


def without_cache(model: nn.Module, kwargs: dict[str, Any], checkpointing: bool) -> dict[str, Any]:
    """``kwargs`` for ``model``'s forward in a training step: ``use_cache=False`` added where
    the model would otherwise make a cache (its config's ``use_cache``) while ``checkpointing``
    recomputes some of its modules; an explicit ``use_cache=True`` fails."""
    if not (checkpointing and model.training) or not _takes_use_cache(type(model)):
        return kwargs
    asked = kwargs.get("use_cache")
    if asked:
        raise ModelParallelError(
            f"{type(model).__name__}(use_cache=True) with smp.set_activation_checkpointing: a "
            "checkpointed layer recomputes its forward in backward and would add its keys and "
            "values to the cache twice; train with use_cache=False"
        )
    if asked is None and getattr(getattr(model, "config", None), "use_cache", False):
        if model not in _warned:
            _warned.add(model)
            warnings.warn(
                f"{type(model).__name__}: use_cache=True (its config's) is incompatible with "
                "activation checkpointing; training with use_cache=False, as Hugging Face's "
                "gradient checkpointing does",
                stacklevel=2,
            )
        return {**kwargs, "use_cache": False}
    return kwargs


_takes: dict[type[nn.Module], bool] = {}
"""Whether a class's forward has a ``use_cache`` keyword: read once per class, as this runs at
every microbatch's call."""


def _takes_use_cache(kind: type[nn.Module]) -> bool:
    if kind not in _takes:
        try:
            _takes[kind] = "use_cache" in inspect.signature(kind.forward).parameters
        except (TypeError, ValueError):  # a builtin or C forward: no keyword to give
            _takes[kind] = False
    return _takes[kind]

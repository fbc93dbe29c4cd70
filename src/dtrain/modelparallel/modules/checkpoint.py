"""Checkpointing one call: SMP's ``checkpoint`` and ``checkpoint_sequential``
(``smdistributed.modelparallel.torch.patches.checkpoint``), and ``torch.utils.checkpoint``
that the model's own code wraps around a module another partition runs.

A call of a module another partition runs is checkpointed by its owner: the caller's stub
(:mod:`..pipeline.caller`) sends the request along (:func:`requested`, :func:`take`), and the
owner runs the module's forward under :func:`~.activations.checkpointed`. A module that runs
here is checkpointed at once. Marks that checkpoint a module at every call: :mod:`.activations`.

``torch.utils.checkpoint`` around a module another partition runs works too. Reentrant: its
forward runs without grad, so the owner keeps nothing; the recomputation in backward calls the
owner again, with grad, and backpropagates through that call (the call's outputs are fetched at
once, as the checkpoint function needs tensors); an argument another partition computed and
nobody fetched is no tensor to that function, which would drop its gradient, so such a call
fails (:mod:`..pipeline.caller`). Non-reentrant: the call is checkpointed by its owner
(:func:`inside_non_reentrant_checkpoint`), as if marked.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from dtrain.errors import ConfigError
from dtrain.modelparallel.modules.activations import (
    CheckpointSpec,
    checkpointed,
    group_runs,
    group_size,
    grouped_forward,
)
from dtrain.modelparallel.modules.stubs import runs_elsewhere

_request: contextvars.ContextVar[tuple[nn.Module, CheckpointSpec] | None] = contextvars.ContextVar(
    "dtrain_checkpoint_request", default=None
)
"""A ``checkpoint(module, ...)`` call of a module another partition runs, for its stub (which
sends it along) or, on the owner, for the module's forward."""


@contextmanager
def requested(module: nn.Module, spec: CheckpointSpec | None) -> Iterator[None]:
    """Within the block, the next call of ``module`` runs checkpointed (see :func:`take`);
    ``None``: as it is."""
    if spec is None:
        yield
        return
    token = _request.set((module, spec))
    try:
        yield
    finally:
        _request.reset(token)


def take(module: nn.Module) -> CheckpointSpec | None:
    """The checkpointing requested for this call of ``module`` (once), if any."""
    request = _request.get()
    if request is None or request[0] is not module:
        return None
    _request.set(None)
    return request[1]


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True) -> Any:
    """SMP's ``checkpoint(module, *args)``: call ``module`` checkpointed, where it runs (a module
    of another partition is checkpointed by its owner). Modules only, as in SMP."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            "checkpoint takes an nn.Module (SMP checkpoints at module granularity), got "
            f"{type(module).__name__}; use torch.utils.checkpoint for a function"
        )
    spec = CheckpointSpec(preserve_rng_state)
    if runs_elsewhere(module):
        with requested(module, spec):
            return module(*args)
    return checkpointed(module, spec)(*args)


def checkpoint_sequential(
    sequential_module: nn.Sequential,
    input: Any,
    strategy: str = "each",
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
) -> Any:
    """SMP's ``checkpoint_sequential``: run the Sequential on ``input`` with its children
    checkpointed in groups (``strategy``); a group never spans partitions, and a child another
    partition runs is checkpointed on its own by its owner."""
    if not isinstance(sequential_module, nn.Sequential):
        raise TypeError(
            f"checkpoint_sequential takes an nn.Sequential, got {type(sequential_module).__name__}"
        )
    if not isinstance(pack_args_as_tuple, bool):
        raise ConfigError(
            "checkpoint_sequential.pack_args_as_tuple", pack_args_as_tuple, "True or False"
        )
    spec = CheckpointSpec(preserve_rng_state)
    children = list(sequential_module)
    elsewhere = [runs_elsewhere(child) for child in children]
    groups = group_runs(children, list(elsewhere), False, group_size(strategy))

    def alone(child: nn.Module, value: Any) -> Any:
        return checkpoint(child, value, preserve_rng_state=preserve_rng_state)

    return grouped_forward(groups, spec, alone)(input)


# --- torch.utils.checkpoint around a remote module ------------------------------------------------

_REENTRANT_CODES = (
    torch.utils.checkpoint.CheckpointFunction.forward.__code__,
    torch.utils.checkpoint.CheckpointFunction.backward.__code__,
)


def inside_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside reentrant ``torch.utils.checkpoint`` (its forward, or
    its recomputation in backward)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _REENTRANT_CODES:
            return True
        frame = frame.f_back
    return False


def inside_non_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside the forward of non-reentrant ``torch.utils.checkpoint``
    (whose saved-tensor hooks are the innermost; not in its recomputation)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")

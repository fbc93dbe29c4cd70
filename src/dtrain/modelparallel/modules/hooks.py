"""Forward hooks that run where their module computes.

Hooks that are part of a module on every rank's copy and do their work where the module runs
(torch's tensor-parallel styles turning a layer's inputs and outputs into DTensors and back)
are marked with :func:`run_where_computed`: a rank that only calls the module on another
partition drops them (:func:`drop_local_hooks`), and the pipeline neither records nor replays
them (:mod:`..pipeline.hooks` replays the others where they were registered).
"""

from __future__ import annotations

from typing import Any

from torch import nn

LOCAL_HOOKS = "_dtrain_local_hooks"
"""The attribute holding the ids of a module's hooks that :func:`run_where_computed` marked."""


def run_where_computed(module: nn.Module, hook_ids: set[int]) -> None:
    """Mark forward hooks of ``module`` (by handle id) that every rank's copy has and that only
    run where the module computes: a remote call neither records nor replays them."""
    setattr(module, LOCAL_HOOKS, getattr(module, LOCAL_HOOKS, frozenset()) | hook_ids)


def drop_local_hooks(module: nn.Module) -> None:
    """Remove the hooks :func:`run_where_computed` marked from ``module``, on a rank where it
    does not compute (called there, it only sends its arguments to its owner)."""
    for key in getattr(module, LOCAL_HOOKS, frozenset()):
        for table in (
            module._forward_pre_hooks,
            module._forward_pre_hooks_with_kwargs,
            module._forward_hooks,
            module._forward_hooks_with_kwargs,
            module._forward_hooks_always_called,
        ):
            table.pop(key, None)
    setattr(module, LOCAL_HOOKS, frozenset())


def replayed(hooks: dict[int, Any], module: nn.Module) -> list[tuple[int, Any]]:
    """``hooks`` (one of ``module``'s hook tables) without those :func:`run_where_computed`
    marked: the ones that run where they were registered."""
    local: frozenset[int] = getattr(module, LOCAL_HOOKS, frozenset())
    return [(key, hook) for key, hook in hooks.items() if key not in local]

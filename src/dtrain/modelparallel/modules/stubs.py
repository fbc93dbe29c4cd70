"""Forward stubs: a module's ``forward`` replaced for the step, its hooks still run.

An engine sets a module's forward up at its first step: the pipeline replaces a module another
partition owns with a stub that sends the call there (:mod:`..pipeline.caller`), and either
engine runs a module marked for checkpointing through a checkpointed forward
(:mod:`.activations`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

REMOTE_STUB = "dtrain_runs_elsewhere"
"""Attribute set on the forward stub of a module another partition owns."""


def install_stub(module: nn.Module, stub: Callable[..., Any]) -> None:
    """Make ``module(...)`` call ``stub`` instead of the module's own forward (hooks still run)."""
    module.forward = stub


def remove_stub(module: nn.Module) -> None:
    module.__dict__.pop("forward", None)


def runs_elsewhere(module: nn.Module) -> bool:
    """Whether calling ``module`` sends the call to the partition that owns it."""
    return getattr(module.__dict__.get("forward"), REMOTE_STUB, False)

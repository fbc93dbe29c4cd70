"""dtrain's switches in the environment, read by one rule.

A switch is on for ``1``, ``true``, ``yes`` or ``on`` and off for ``0``, ``false``, ``no`` or
``off`` (any case, spaces around ignored); unset or empty, it keeps its default. Any other value
fails naming the variable and what it takes: a misspelt ``DTRAIN_SHM_ALLREDUCE=ture`` must not
silently choose for the user.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import overload

from dtrain.errors import ConfigError

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


@overload
def switch(name: str, default: bool, environ: Mapping[str, str] = ...) -> bool: ...
@overload
def switch(name: str, default: None, environ: Mapping[str, str] = ...) -> bool | None: ...
def switch(name: str, default: bool | None, environ: Mapping[str, str] = os.environ) -> bool | None:
    """The switch ``name`` (see the module docstring); ``default`` when it is unset or empty."""
    raw = environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ConfigError(name, raw, f"one of {', '.join(ON)} (on) or {', '.join(OFF)} (off)")

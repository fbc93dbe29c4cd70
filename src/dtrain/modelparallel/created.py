"""Seeing modules as they are created: ``smp.partition`` and ``smp.tensor_parallelism`` mark the
modules built inside them.

While a watcher is open on any thread, ``nn.Module.__init__`` is wrapped so that every module
created on that thread is shown to the thread's open watchers, outermost first (so the
innermost context's mark is the one that stays). A module counts where it was built, not where
it was later assigned as an attribute, and top-level models count too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

Watcher = Callable[[nn.Module], None]

_local = threading.local()
_patch_lock = threading.Lock()
_open = 0
_original_init = nn.Module.__init__


def _watchers() -> list[Watcher]:
    if not hasattr(_local, "watchers"):
        _local.watchers = []
    return _local.watchers


def _watched_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    for watcher in _watchers():
        watcher(self)


@contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Show every module created on this thread inside the block to ``watcher``."""
    global _open
    with _patch_lock:
        if _open == 0:
            nn.Module.__init__ = _watched_init  # type: ignore[method-assign]  # every creation watched
        _open += 1
    _watchers().append(watcher)
    try:
        yield
    finally:
        _watchers().pop()
        with _patch_lock:
            _open -= 1
            if _open == 0:
                nn.Module.__init__ = _original_init  # type: ignore[method-assign]  # torch's again

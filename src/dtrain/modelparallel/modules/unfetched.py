"""Values a module call elsewhere will produce, not fetched yet, and their fetching.

A pipeline returns the outputs of a call to a module another partition owns as such values
(:class:`~..pipeline.remote.RemoteValue`): passed to another module of that partition they stay
there, and any other use fetches them. Code that takes a module's outputs apart by hand (a
tensor-parallel region cutting its rows) fetches them first, with :func:`materialize`.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.modelparallel.transport.structure import map_leaves


class Unfetched:
    """A tensor computed elsewhere; :meth:`fetch` brings it here (once)."""

    __slots__ = ()

    def fetch(self) -> torch.Tensor:
        raise NotImplementedError


def materialize(obj: Any) -> Any:
    """``obj`` with every :class:`Unfetched` value in it (nested) fetched; ``obj`` itself when
    it holds none (every owned module's call passes its arguments through here: most hold
    only tensors, and a look costs less than a copy)."""
    if not _holds_unfetched(obj):
        return obj
    return map_leaves(obj, lambda v: v.fetch() if isinstance(v, Unfetched) else v)


def _holds_unfetched(obj: Any) -> bool:
    """Whether an :class:`Unfetched` value is among the leaves of ``obj`` (as
    :func:`~..transport.structure.map_leaves` sees them)."""
    if isinstance(obj, Unfetched):
        return True
    if isinstance(obj, dict):
        obj = obj.values()
    elif not isinstance(obj, (tuple, list)):
        return False
    return any(map(_holds_unfetched, obj))

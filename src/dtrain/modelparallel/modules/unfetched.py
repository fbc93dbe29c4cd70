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
    """``obj`` with every :class:`Unfetched` value in it (nested) fetched."""
    return map_leaves(obj, lambda v: v.fetch() if isinstance(v, Unfetched) else v)

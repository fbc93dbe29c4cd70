"""Nested values (tuples, lists, dicts of anything) walked leaf by leaf: arguments, outputs,
messages and records all go through :func:`map_with_path`; :func:`flatten` takes the tensors out
of a structure that travels without them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtrain.modelparallel.transport.message import TensorRef


def map_with_path(
    obj: Any, fn: Callable[[Any, tuple[Any, ...]], Any], path: tuple[Any, ...] = ()
) -> Any:
    """``obj`` with every leaf (anything but a tuple, list or dict) replaced by
    ``fn(leaf, path)``, ``path`` being the keys and indices that lead to it (see
    :func:`resolve`). Containers keep their types (named tuples and dict subclasses included).

    The one walk over nested values: arguments, outputs, messages and records all go through it.
    """
    return _mapped(obj, fn, path)


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with every leaf replaced by ``fn(leaf)`` (see :func:`map_with_path`)."""
    return _mapped(obj, fn, None)


def _mapped(obj: Any, fn: Callable[..., Any], path: tuple[Any, ...] | None) -> Any:
    """The walk of :func:`map_with_path`; with ``path`` None, ``fn`` takes the leaf alone and
    no paths are built (every module call on a rank walks its arguments: it adds up)."""
    if not isinstance(obj, (tuple, list, dict)):
        return fn(obj) if path is None else fn(obj, path)
    if isinstance(obj, dict):
        return type(obj)(
            (k, _mapped(v, fn, None if path is None else (*path, k))) for k, v in obj.items()
        )
    items = [_mapped(v, fn, None if path is None else (*path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, list):
        return items
    return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace tensors in nested tuples/lists/dicts by :class:`TensorRef`; return both parts."""
    tensors: list[torch.Tensor] = []

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return TensorRef(len(tensors) - 1)
        return value

    return map_leaves(obj, visit), tensors


def unflatten(structure: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`."""
    return map_leaves(structure, lambda v: tensors[v.index] if isinstance(v, TensorRef) else v)


def resolve(obj: Any, path: tuple[Any, ...]) -> Any:
    """The part of a nested structure at ``path`` (keys or indices, outermost first)."""
    for key in path:
        obj = obj[key]
    return obj

"""Manual placement: which pipeline partition a module goes to (``smp.partition``).

Modules *created* inside ``with smp.partition(i):`` go to partition ``i`` (the innermost context
wins; see :mod:`.created`); ``smp.set_partition`` assigns existing modules.

SMP ignores manual placements when ``auto_partition`` is true; dtrain keeps them as constraints
of the automatic plan instead (the partitioner places the rest around them).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from dtrain.modelparallel import created, state
from dtrain.modelparallel.errors import PartitionError

_assigned: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def _check_index(index: object, what: str) -> int:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise PartitionError(f"{what}: partition must be a non-negative integer, got {index!r}")
    if state.is_initialized():
        size = state.current().pp_size
        if index >= size:
            raise PartitionError(
                f"{what}: partition {index} does not exist; allowed: 0 to {size - 1} "
                f"(pipeline_parallel_degree is {size})"
            )
    return index


@contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created inside go to pipeline partition ``index`` (innermost context wins)."""
    _check_index(index, "smp.partition")

    def assign(module: nn.Module) -> None:
        _assigned[module] = index

    with created.watching(assign):
        yield


def set_partition(module: nn.Module, partition: int, recurse: bool = True) -> None:
    """Place an existing module (and with ``recurse`` its submodules) on ``partition``.

    Must come before the first step: the plan is fixed when the model is partitioned.
    """
    _check_index(partition, "smp.set_partition")
    if not isinstance(module, nn.Module):
        raise TypeError(f"smp.set_partition places an nn.Module, got {type(module).__name__}")
    if getattr(state.current_model(), "partitioned", False):
        raise PartitionError(
            "smp.set_partition after the first step has no effect: the model is already "
            "partitioned; call it before the first smp.step call"
        )
    for each in module.modules() if recurse else (module,):
        _assigned[each] = partition


def manual_placements(root: nn.Module) -> dict[str, int]:
    """Partition of every manually placed module under ``root``, by qualified name."""
    return {name: _assigned[m] for name, m in root.named_modules() if m in _assigned}


def keep_placements(root: nn.Module, placements: dict[str, int]) -> None:
    """A module swapped for another under ``root`` (tensor parallelism's swap) takes the
    partition of the one it replaced, given by name in ``placements``, for its whole subtree."""
    for name, module in root.named_modules():
        if name in placements and module not in _assigned:
            for each in module.modules():
                _assigned.setdefault(each, placements[name])


def clear() -> None:
    """Forget every manual placement (``smp.reset``)."""
    _assigned.clear()


state.on_reset(clear)

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


def keep_placements(
    root: nn.Module, placements: dict[str, int], before: dict[str, nn.Module]
) -> None:
    """Carry the manual ``placements`` made on a model (by name; ``before``: its modules by
    name) over to ``root``, the model after tensor parallelism's swap. A module swapped for
    another takes the partition of the one it replaced, for its whole subtree. A module gone
    with the swap is found again where the swap kept it under another name: a layer of a list
    (``transformer.h.2`` of a GPT-2 model) is the layer of the same index in the one list of as
    many layers its replacement holds (``transformer.seq_layers.2``), as is the list itself. A
    placement neither kept nor covered by its parent's fails, naming it: the plan would
    silently ignore it."""
    after = dict(root.named_modules())
    kept: dict[str, int] = {}
    for name in sorted(placements, key=lambda n: (n.count("."), n)):  # parents first
        partition = placements[name]
        target = name if name in after else _renamed(name, before, after)
        if target is not None:
            kept[name] = partition
            if after[target] is not before.get(name):
                for each in after[target].modules():
                    _assigned.setdefault(each, partition)
            continue
        parents = [n for n in kept if n == "" or name.startswith(f"{n}.")]
        parent = max(parents, key=len, default=None)
        if parent is None or kept[parent] != partition:
            raise PartitionError(
                f"smp.set_partition placed module {name!r} on partition {partition} before "
                "the model was wrapped, but tensor parallelism swapped it for modules of "
                "other names"
                + ("" if parent is None else f" (under {parent!r}, on partition {kept[parent]})")
                + "; place the swapped model's modules after wrapping instead: "
                f"smp.set_partition(model.get_module().<name>, {partition}), for a name of "
                "model.get_module().named_modules()"
            )
        kept[name] = partition


LAYER_LISTS = (nn.ModuleList, nn.Sequential)
"""Modules holding layers by index, which a swap may keep under another name."""


def _renamed(name: str, before: dict[str, nn.Module], after: dict[str, nn.Module]) -> str | None:
    """Where the swap put module ``name`` (gone from ``after``), if a layer list tells: the
    list (:data:`LAYER_LISTS`) of ``before`` holding it (or it, a list) maps to the one list
    of as many layers under the module that replaced their ancestor."""
    holder, _, index = name.rpartition(".")
    if not (index.isdigit() and isinstance(before.get(holder), LAYER_LISTS)):
        holder, index = name, ""
    layers = before.get(holder)
    if not isinstance(layers, LAYER_LISTS):
        return None
    parts = holder.split(".")
    prefixes = ["", *(".".join(parts[: i + 1]) for i in range(len(parts)))]
    swapped = [p for p in prefixes if p in after and after[p] is not before.get(p)]
    if not swapped:
        return None
    lists = [
        path
        for path, module in after[swapped[0]].named_modules(prefix=swapped[0])
        if isinstance(module, LAYER_LISTS) and len(module) == len(layers)
    ]
    if len(lists) != 1:
        return None
    return ".".join(part for part in (lists[0], index) if part)


def clear() -> None:
    """Forget every manual placement (``smp.reset``)."""
    _assigned.clear()


state.on_reset(clear)

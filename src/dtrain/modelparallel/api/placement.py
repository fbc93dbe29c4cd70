"""Manual placement: which pipeline partition a module goes to (``smp.partition``).

Modules *created* inside ``with smp.partition(i):`` go to partition ``i`` (the innermost context
wins); ``smp.set_partition`` assigns existing modules. Creation is seen by wrapping
``nn.Module.__init__`` while a context is open on any thread, so a module counts where it was
built, not where it was later assigned as an attribute, and top-level models count too.

SMP ignores manual placements when ``auto_partition`` is true; dtrain keeps them as constraints
of the automatic plan instead (the partitioner places the rest around them).

Tensor parallelism is not supported; its SMP entry points raise a clear error.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NoReturn

from torch import nn

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError, PartitionError

_assigned: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_local = threading.local()
_patch_lock = threading.Lock()
_open_contexts = 0
_original_init = nn.Module.__init__


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


def _stack() -> list[int]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _recording_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    stack = _stack()
    if stack:
        _assigned[self] = stack[-1]


@contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created inside go to pipeline partition ``index`` (innermost context wins)."""
    global _open_contexts
    _check_index(index, "smp.partition")
    with _patch_lock:
        if _open_contexts == 0:
            nn.Module.__init__ = _recording_init  # type: ignore[method-assign]
        _open_contexts += 1
    _stack().append(index)
    try:
        yield
    finally:
        _stack().pop()
        with _patch_lock:
            _open_contexts -= 1
            if _open_contexts == 0:
                nn.Module.__init__ = _original_init  # type: ignore[method-assign]


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


def clear() -> None:
    """Forget every manual placement (``smp.reset``)."""
    _assigned.clear()


state.on_reset(clear)


# --- tensor parallelism: not supported ------------------------------------------------------


def _no_tensor_parallelism(what: str) -> NoReturn:
    raise ModelParallelError(
        f"{what}: tensor parallelism is not supported by dtrain (tensor_parallel_degree must "
        "be 1); remove it, or pass enabled=False"
    )


def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> nullcontext[None]:
    """SMP's tensor-parallel context: only ``enabled=False`` (a no-op) is accepted."""
    if enabled:
        _no_tensor_parallelism("smp.tensor_parallelism")
    return nullcontext()


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """SMP's per-module tensor-parallel switch: only ``enabled=False`` (a no-op) is accepted."""
    if enabled:
        _no_tensor_parallelism("smp.set_tensor_parallelism")


def tp_register(dist_module: type, *args: Any, **kwargs: Any) -> NoReturn:
    """SMP's registration of a tensor-parallel replacement module: not supported."""
    _no_tensor_parallelism("smp.tp_register")


def tp_register_with_module(
    module_cls: type, dist_module: type, *args: Any, **kwargs: Any
) -> NoReturn:
    """SMP's registration of a tensor-parallel replacement module: not supported."""
    _no_tensor_parallelism("smp.tp_register_with_module")


class _TensorParallelModules:
    """``smp.nn``: SMP's distributed (tensor-parallel) modules, which dtrain does not provide."""

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        _no_tensor_parallelism(f"smp.nn.{name}")


nn_modules = _TensorParallelModules()

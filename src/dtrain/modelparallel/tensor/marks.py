"""Which modules are to be distributed, and by what: ``smp.tensor_parallelism``,
``smp.set_tensor_parallelism``, ``smp.tp_register`` and ``smp.tp_register_with_module``.

Marking changes nothing yet: as in SMP, the marked modules of a registered class are swapped
for their distributed counterparts when the model is wrapped in ``smp.DistributedModel``
(:mod:`.swap`), so a model is built, and may be loaded, as the plain model first. This module
imports no DTensor, so ``import dtrain.modelparallel`` stays quick.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dtrain.modelparallel import created, state
from dtrain.modelparallel.errors import ModelParallelError

Args = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Mark:
    """What a ``tensor_parallelism`` context or ``set_tensor_parallelism`` said of a module:
    whether to distribute it, and arguments overriding its distributed module's."""

    enabled: bool
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Registration:
    """A class's distributed counterpart and SMP's three hooks: ``init_hook(*args, **kwargs)``
    turns the original's constructor arguments into ``(args, kwargs)`` of ``dist_module``,
    ``forward_hook(*args, **kwargs)`` its forward inputs likewise, ``return_hook(outputs)``
    the distributed module's outputs into the original's."""

    dist_module: type[nn.Module]
    init_hook: Callable[..., Args] | None = None
    forward_hook: Callable[..., Args] | None = None
    return_hook: Callable[[Any], Any] | None = None


_registered: dict[type[nn.Module], Registration] = {}
_marks: weakref.WeakKeyDictionary[nn.Module, Mark] = weakref.WeakKeyDictionary()
_init_args: weakref.WeakKeyDictionary[nn.Module, Args] = weakref.WeakKeyDictionary()


@contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Modules created inside are distributed when the model is wrapped (``enabled=False``:
    not, inside an enabled context); ``kwargs`` override the arguments of the distributed
    modules that accept them. The innermost context wins."""
    mark = Mark(bool(enabled), dict(kwargs))

    def remember(module: nn.Module) -> None:
        _marks[module] = mark

    with created.watching(remember):
        yield


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Mark an existing module and its submodules (after creation, before
    ``smp.DistributedModel``)."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"smp.set_tensor_parallelism marks an nn.Module, got {type(module).__name__}"
        )
    if state.current_model() is not None:
        raise ModelParallelError(
            "smp.set_tensor_parallelism after smp.DistributedModel has no effect: modules are "
            "distributed when the model is wrapped; call it before"
        )
    mark = Mark(bool(enabled), dict(kwargs))
    for each in module.modules():
        _marks[each] = mark


def tp_register(
    dist_module: type[nn.Module],
    init_hook: Callable[..., Args] | None = None,
    forward_hook: Callable[..., Args] | None = None,
    return_hook: Callable[[Any], Any] | None = None,
) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: marked instances of the class become ``dist_module``s."""
    _check_class("dist_module", dist_module)

    def register(module_cls: type[nn.Module]) -> type[nn.Module]:
        tp_register_with_module(module_cls, dist_module, init_hook, forward_hook, return_hook)
        return module_cls

    return register


def tp_register_with_module(
    module_cls: type[nn.Module],
    dist_module: type[nn.Module],
    init_hook: Callable[..., Args] | None = None,
    forward_hook: Callable[..., Args] | None = None,
    return_hook: Callable[[Any], Any] | None = None,
) -> None:
    """Marked instances of ``module_cls`` become ``dist_module``s (built from the constructor
    arguments of each instance, which are recorded from now on)."""
    _check_class("module_cls", module_cls)
    _check_class("dist_module", dist_module)
    for name, hook in (
        ("init_hook", init_hook),
        ("forward_hook", forward_hook),
        ("return_hook", return_hook),
    ):
        if hook is not None and not callable(hook):
            raise TypeError(f"smp.tp_register: {name} must be callable or None, got {hook!r}")
    _registered[module_cls] = Registration(dist_module, init_hook, forward_hook, return_hook)
    _record_init_args(module_cls)


def _check_class(name: str, cls: object) -> None:
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"smp.tp_register: {name} must be an nn.Module class, got {cls!r}")


def _record_init_args(module_cls: type[nn.Module]) -> None:
    """Wrap ``module_cls.__init__`` (once) to keep each instance's arguments."""
    if "_dtrain_records_args" in module_cls.__dict__:
        return
    original = module_cls.__init__

    @functools.wraps(original)
    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self) is module_cls:
            _init_args[self] = (args, kwargs)

    module_cls.__init__ = init  # type: ignore[method-assign]  # keeps instances' arguments
    module_cls._dtrain_records_args = True  # type: ignore[attr-defined]  # marks it wrapped


def registered() -> dict[type[nn.Module], Registration]:
    """The user's registrations (they override the built-in ones)."""
    return dict(_registered)


def mark_of(module: nn.Module) -> Mark | None:
    return _marks.get(module)


def any_marked(root: nn.Module) -> bool:
    """Whether a module under ``root`` is marked to be distributed: SMP swaps those at
    ``tensor_parallel_degree`` 1 too (AWS's GPT-2 script reads the swapped model's layers)."""
    return any((mark := _marks.get(m)) is not None and mark.enabled for m in root.modules())


def init_args_of(module: nn.Module) -> Args | None:
    """The constructor arguments of an instance of a registered class, if recorded."""
    return _init_args.get(module)


def clear() -> None:
    """Forget every mark (``smp.reset``); registrations, made by class decorators, stay."""
    _marks.clear()


state.on_reset(clear)

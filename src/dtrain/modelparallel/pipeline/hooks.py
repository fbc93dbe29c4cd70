"""Forward hooks on modules that run on another rank: recorded where the module runs, run where
they were registered.

A hook is a closure in the memory of the process that registered it. Libraries collect results
with hooks (Hugging Face ``transformers`` gathers ``output_attentions`` and
``output_hidden_states`` from hooks on every layer), so a hook on a module another partition
runs would silently never fire. Instead, a call to a remote module whose submodules carry
forward hooks here asks its owner to record each such submodule's arguments and output; the
reply brings the records back and the hooks run here, in call order, on this rank's copy of the
submodule. What a replayed hook cannot do fails loudly, naming it: replace a module's inputs or
outputs (unless the owner has hooks of its own on that module, which did it there), or send a
gradient into a recorded value. Backward hooks on such submodules are refused.

Hooks that are part of a module on every rank's copy and do their work where the module runs
(torch's tensor-parallel styles turning a layer's inputs and outputs into DTensors and back)
are marked with :func:`~..modules.hooks.run_where_computed` and never replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules.hooks import replayed
from dtrain.modelparallel.transport.message import TensorRef
from dtrain.modelparallel.transport.structure import map_leaves

Record = tuple[str, tuple[Any, ...], dict[str, Any], Any]
"""One recorded call: the submodule's name, its positional and keyword arguments, its output."""


@dataclass(frozen=True)
class Unavailable:
    """Stands for an argument or output value that does not travel back with a record (only
    tensors, numbers, strings and ``None`` do)."""

    type_name: str

    def __repr__(self) -> str:
        return f"<{self.type_name} recorded on another rank: not available here>"


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward hooks that run where they were registered."""
    return bool(
        replayed(module._forward_hooks, module) or replayed(module._forward_pre_hooks, module)
    )


def hooked_submodules(root: str, subtree: list[tuple[str, nn.Module]]) -> list[str]:
    """The submodules (below the remote module ``root``) whose forward hooks must be replayed
    here; a backward hook among them fails, naming it."""
    hooked = []
    for name, module in subtree:
        if module._backward_hooks or module._backward_pre_hooks:
            backward = [*module._backward_hooks.values(), *module._backward_pre_hooks.values()]
            raise ModelParallelError(
                f"backward hook {_hook_name(backward[0])} on module {name!r} cannot run: the "
                f"module runs on another partition (inside {root!r}). Register it on a module "
                "this rank owns, or use a tensor hook inside the module's forward"
            )
        if has_forward_hooks(module):
            hooked.append(name)
    return hooked


def _portable(value: Any) -> Any:
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return value
    return Unavailable(type(value).__name__)


@contextlib.contextmanager
def recording(modules: dict[str, nn.Module], names: list[str]) -> Iterator[list[Record]]:
    """Record the calls of the named modules in the block (run last, after their own hooks)."""
    records: list[Record] = []
    handles = []

    def recorder(name: str) -> Any:
        def record(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            records.append((name, *map_leaves((args, kwargs, out), _portable)))

        return record

    try:
        for name in names:
            handles.append(modules[name].register_forward_hook(recorder(name), with_kwargs=True))
        yield records
    finally:
        for handle in handles:
            handle.remove()


def owners_hooks(modules: dict[str, nn.Module], names: list[str]) -> list[str]:
    """Which of the named modules have forward hooks on the owner itself (they ran there)."""
    return [name for name in names if has_forward_hooks(modules[name])]


class _RecordedValue(torch.autograd.Function):
    """A recorded tensor that required grad: differentiable in form, refusing a gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor, where: str) -> torch.Tensor:
        del anchor
        ctx.where = where
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        raise ModelParallelError(
            f"a gradient reached a value recorded for a forward hook on {ctx.where}, which runs "
            "on another partition: recorded values carry no gradient. Compute what needs a "
            "gradient inside the model"
        )


def _received(tensor: torch.Tensor, differentiable: bool, where: str) -> torch.Tensor:
    if not differentiable:
        return tensor
    with torch.enable_grad():
        anchor = torch.empty(0, requires_grad=True)
        return _RecordedValue.apply(anchor, tensor, where)


def replay(
    modules: dict[str, nn.Module],
    records: list[Record],
    tensors: list[torch.Tensor],
    differentiable: list[bool],
    native: set[str],
) -> None:
    """Run this rank's forward hooks of each recorded call, in order.

    ``records`` hold :class:`TensorRef` placeholders for ``tensors``; those that required grad
    where they were computed (``differentiable``) refuse a gradient here (see
    :class:`_RecordedValue`). ``native``: the modules whose owner has hooks of its own (a hook
    that replaces a value did so there).
    """
    for name, *values in records:
        module = modules[name]

        def tensor(v: Any, where: str = f"module {name!r}") -> Any:
            if not isinstance(v, TensorRef):
                return v
            return _received(tensors[v.index], differentiable[v.index], where)

        args, kwargs, output = map_leaves(tuple(values), tensor)
        for key, hook in replayed(module._forward_pre_hooks, module):
            if key in module._forward_pre_hooks_with_kwargs:
                result = hook(module, args, kwargs)
            else:
                result = hook(module, args)
            _check_result(result, hook, "forward pre-hook", name, native)
        for key, hook in replayed(module._forward_hooks, module):
            if key in module._forward_hooks_with_kwargs:
                result = hook(module, args, kwargs, output)
            else:
                result = hook(module, args, output)
            _check_result(result, hook, "forward hook", name, native)


def _check_result(result: Any, hook: Any, kind: str, name: str, native: set[str]) -> None:
    if result is not None and name not in native:
        raise ModelParallelError(
            f"{kind} {_hook_name(hook)} on module {name!r} returned a value, but the module "
            "runs on another partition, where the value cannot take effect. Register the hook "
            "in the script on every rank (it then runs where the module does), or return None"
        )

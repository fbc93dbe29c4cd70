"""Calling a module that lives on another rank, with autograd flowing back through the call.

On a rank that does not own a module, the module's ``forward`` is replaced by a stub that sends
the call (arguments of any nesting, tensors and picklable values, keyword arguments included) to
the owner and returns the owner's outputs. The call is one node of the caller's autograd graph
(:class:`RemoteCall`): its backward sends the output gradients to the owner, which runs the
backward of the graph it kept for that call and returns the gradients of the call's inputs.

An empty *anchor* tensor that requires grad is passed along with the real inputs, so the outputs
require grad even when no input does (integer token ids into an embedding on another rank): the
owner's parameters must still get their gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.modelparallel.transport import TensorMeta, flatten, unflatten

if TYPE_CHECKING:
    from dtrain.modelparallel.runtime import PipelineRuntime


@dataclass
class CallRecord:
    """Caller-side state of one remote call, shared by its forward and backward."""

    runtime: PipelineRuntime
    module: str
    owner: int
    input_count: int = 0
    call_id: int = 0
    output_structure: Any = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    output_meta: tuple[TensorMeta, ...] = field(default_factory=tuple)


class RemoteCall(torch.autograd.Function):
    """Autograd node of a remote call: forward and backward both run on the owner."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, record: CallRecord, anchor: torch.Tensor, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        del (
            anchor,
            inputs,
        )  # the owner already computed the outputs; these put the call on the graph
        outputs = record.outputs
        ctx.record = record
        ctx.set_materialize_grads(False)
        frozen = [
            t for t, meta in zip(outputs, record.output_meta, strict=True) if not meta.requires_grad
        ]
        ctx.mark_non_differentiable(*frozen)
        ctx.input_count = record.input_count
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        record: CallRecord = ctx.record
        if all(g is None for g in grads):
            return (None, None) + (None,) * ctx.input_count
        input_grads = record.runtime.backward_call(record, list(grads))
        return (None, None, *input_grads)


def call_remote(
    runtime: PipelineRuntime, module: str, owner: int, args: tuple[Any, ...], kwargs: dict
) -> Any:
    """Run ``module(*args, **kwargs)`` on partition ``owner``; its result as the owner made it."""
    structure, tensors = flatten((args, kwargs))
    record = CallRecord(runtime, module, owner, input_count=len(tensors))
    grad = torch.is_grad_enabled()
    runtime.forward_call(record, structure, tensors, grad)
    outputs: tuple[torch.Tensor, ...] | list[torch.Tensor] = record.outputs
    if grad and any(meta.requires_grad for meta in record.output_meta):
        anchor = torch.empty(0, requires_grad=True)
        outputs = RemoteCall.apply(record, anchor, *tensors)
    record.outputs = []  # the graph holds them now
    return unflatten(record.output_structure, list(outputs))


def install_stub(module: nn.Module, stub: Callable[..., Any]) -> None:
    """Make ``module(...)`` call ``stub`` instead of the module's own forward (hooks still run)."""
    module.forward = stub  # type: ignore[method-assign]


def remove_stub(module: nn.Module) -> None:
    module.__dict__.pop("forward", None)

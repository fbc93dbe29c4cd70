"""``@smp.step``: run a training step's body once per microbatch, pipelined across partitions.

Tensor arguments (also inside tuples, lists and dicts) are split along their batch axis into
``microbatches`` pieces, on the device the leader computes on; other values, and the arguments
named in ``non_split_inputs``, are passed to every microbatch unchanged. The body runs
on the pipeline leader, one task per microbatch; every rank of the pipeline returns the same
result: a :class:`StepOutput` for each tensor the body returned, a per-microbatch list for any
other value.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

import torch

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import MicrobatchSplitError, ModelParallelError

F = TypeVar("F", bound=Callable[..., Any])


class StepOutput:
    """The values one tensor output of the step function took in each microbatch."""

    def __init__(self, outputs: Sequence[torch.Tensor]) -> None:
        self.outputs = list(outputs)

    def reduce_mean(self) -> torch.Tensor:
        return self.reduce_sum() / len(self.outputs)

    def reduce_sum(self) -> torch.Tensor:
        return functools.reduce(torch.add, self.outputs)

    def concat(self) -> torch.Tensor:
        return torch.cat(self.outputs, dim=0)

    def stack(self) -> torch.Tensor:
        return torch.stack(self.outputs)

    def map(self, func: Callable[[torch.Tensor], Any]) -> list[Any]:
        return [func(t) for t in self.outputs]

    def clear(self) -> None:
        self.outputs.clear()

    def __getitem__(self, microbatch: int) -> torch.Tensor:
        return self.outputs[microbatch]

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.outputs)

    def __repr__(self) -> str:
        return f"StepOutput({self.outputs!r})"


# --- splitting inputs ------------------------------------------------------------------------


def split_value(
    value: Any, count: int, axis: int, where: str, device: torch.device | None = None
) -> list[Any]:
    """``count`` microbatch pieces of ``value``; ``where`` names it in errors. Its tensors are
    moved to ``device`` (when given): SMP's scripts move their batches themselves, but one left
    on the CPU (or on another GPU) would otherwise meet the model's first module on the rank's
    GPU, or the profiling step on another device than the model."""
    if isinstance(value, torch.Tensor):
        if device is not None:
            value = value.to(device)
        if value.dim() == 0:
            return [value] * count
        if not -value.dim() <= axis < value.dim():
            raise MicrobatchSplitError(
                f"step argument {where!r} has {value.dim()} dimensions; it cannot be split along "
                f"axis {axis} (set input_split_axes, or list it in non_split_inputs)"
            )
        size = value.shape[axis]
        if size % count:
            raise MicrobatchSplitError(
                f"step argument {where!r} has batch size {size} along axis {axis}, which is not "
                f"divisible by microbatches={count}: use a batch size that is a multiple of "
                f"{count}, or list the argument in non_split_inputs"
            )
        return list(torch.split(value, size // count, dim=axis))
    if hasattr(value, "smp_slice"):
        return [value.smp_slice(count, mb, axis) for mb in range(count)]
    if isinstance(value, (tuple, list)):
        parts = [split_value(v, count, axis, f"{where}[{i}]", device) for i, v in enumerate(value)]
        pieces = [[part[mb] for part in parts] for mb in range(count)]
        if isinstance(value, list):
            return pieces
        if hasattr(value, "_fields"):
            return [type(value)(*piece) for piece in pieces]
        return [type(value)(piece) for piece in pieces]
    if isinstance(value, Mapping):
        parts_by_key = {
            k: split_value(v, count, axis, f"{where}[{k!r}]", device) for k, v in value.items()
        }
        mapping: Any = type(value)  # the script's mapping class, made from pairs as dict is
        return [mapping((k, p[mb]) for k, p in parts_by_key.items()) for mb in range(count)]
    return [value] * count


def split_arguments(
    bound: inspect.BoundArguments,
    count: int,
    non_split_inputs: Sequence[str],
    input_split_axes: Mapping[str, int],
    device: torch.device | None = None,
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The step function's ``(args, kwargs)`` for each microbatch, the split arguments' tensors
    on ``device`` (when given); ``non_split_inputs`` stay as they are, where they are."""
    arguments = dict(bound.arguments)
    per_name: dict[str, list[Any]] = {}
    for name, value in arguments.items():
        if name in non_split_inputs:
            per_name[name] = [value] * count
        else:
            axis = input_split_axes.get(name, 0)
            per_name[name] = split_value(value, count, axis, name, device)
    calls = []
    for mb in range(count):
        for name in arguments:
            bound.arguments[name] = per_name[name][mb]
        calls.append((bound.args, dict(bound.kwargs)))
    return calls


# --- assembling outputs ----------------------------------------------------------------------


def assemble(values: list[Any], detach: bool) -> Any:
    """Per-microbatch return values → one structure with a StepOutput at each tensor."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return StepOutput([v.detach() if detach else v for v in values])
    if isinstance(first, (tuple, list)) and all(
        type(v) is type(first) and len(v) == len(first) for v in values
    ):
        items = [assemble([v[i] for v in values], detach) for i in range(len(first))]
        if isinstance(first, list):
            return items
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if isinstance(first, dict) and all(
        isinstance(v, dict) and v.keys() == first.keys() for v in values
    ):
        return type(first)((k, assemble([v[k] for v in values], detach)) for k in first)
    return list(values)


# --- the decorator ---------------------------------------------------------------------------


@overload
def step(func: F) -> F: ...


@overload
def step(
    func: None = None,
    *,
    non_split_inputs: Sequence[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    detach_outputs: bool = True,
) -> Callable[[F], F]: ...


def step(
    func: F | None = None,
    *,
    non_split_inputs: Sequence[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    detach_outputs: bool = True,
) -> F | Callable[[F], F]:
    """Mark a function holding the forward and backward of a training or evaluation step.

    Usable bare (``@smp.step``) or called (``@smp.step(non_split_inputs=["mask"])``).
    """
    if func is None:
        return functools.partial(
            step,
            non_split_inputs=non_split_inputs,
            input_split_axes=input_split_axes,
            detach_outputs=detach_outputs,
        )
    signature = inspect.signature(func)
    unsplit = tuple(non_split_inputs or ())
    axes = dict(input_split_axes or {})
    for name in (*unsplit, *axes):
        if name not in signature.parameters:
            raise ModelParallelError(
                f"@smp.step: {name!r} is not an argument of {func.__name__}"
                f"{signature}; non_split_inputs and input_split_axes name its arguments"
            )

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        count = state.num_microbatches()
        model = state.current_model()
        if model is None:
            raise ModelParallelError(
                "the step function needs a model: create smp.DistributedModel(module) first"
            )

        def make_body(device: torch.device) -> Callable[[int], Any]:
            bound = signature.bind(*args, **kwargs)
            calls = split_arguments(bound, count, unsplit, axes, device)
            return lambda mb: func(*calls[mb][0], **calls[mb][1])

        outcomes = model.run_step(count, make_body)
        for ok, value in outcomes:
            if not ok:
                raise value
        return assemble([value for _, value in outcomes], detach_outputs)

    return run

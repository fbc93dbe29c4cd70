"""Which parameters saw the tp group's combined batch, and how every gradient averages.

A distributed module computes on the batches of its whole tp group (:mod:`.batch`): its
parameters (SMP's "scaled batch" parameters) hold gradients summed over those batches, where a
plain parameter's covers its rank's own. The averages over the data-parallel ranks differ
accordingly, by one rule (:func:`averages`) whichever engine runs the model: the pipelines
average on their own, sharded data parallelism completes FSDP2's mean.

This module imports no DTensor: a pipelined model without tensor parallelism uses it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dtrain.modelparallel.tensor.dtensors import local

if TYPE_CHECKING:
    import torch.distributed as dist

    from dtrain.modelparallel.state import MPState

SCALED_BATCH = "_dtrain_scaled_batch"
"""The attribute marking a parameter of a distributed module (set on the parameter itself: a
set of tensors would compare them by value)."""

SCALED_NAMES = "_dtrain_scaled_batch_names"
"""The attribute of a module recording which of its own parameters carry :data:`SCALED_BATCH`
(name to mark): torch's conversions (``Module.to``, ``.cuda()``, ``.half()``) swap a DTensor
parameter with its converted copy, ``__dict__`` included, which drops the mark, and so does
FSDP2's sharding; the module keeps it, and :func:`restore_marks` puts it back (the engines do
when the model is wrapped and at every step)."""


def mark_scaled_batch(module: nn.Module, scaled: bool) -> None:
    """Mark every parameter of ``module`` as one that sees the group's combined batch, or (not
    ``scaled``) its rank's own rows, on the parameter and in its module's record."""
    for sub in module.modules():
        names = sub.__dict__.setdefault(SCALED_NAMES, {})
        for name, param in sub.named_parameters(recurse=False):
            names[name] = scaled
            setattr(param, SCALED_BATCH, scaled)


def restore_marks(root: nn.Module) -> None:
    """Put the marks of :func:`mark_scaled_batch` back on the parameters of ``root`` from their
    modules' records (after a conversion swapped them away)."""
    for sub in root.modules():
        for name, scaled in getattr(sub, SCALED_NAMES, {}).items():
            param = sub._parameters.get(name)
            if param is not None:
                setattr(param, SCALED_BATCH, scaled)


def is_scaled_batch(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter of a distributed module (SMP's "scaled batch"
    parameters): its gradient covers the batches of the whole tp group."""
    return getattr(tensor, SCALED_BATCH, False)


def tp_batches(st: MPState) -> int:
    """How many batches a scaled-batch parameter's gradient sums on one rank: the tp group's
    (its ranks' batches, combined), or one with ``prescaled_batch`` (the group shares one). Its
    average divides by this beside the rdp degree; a plain parameter's is a mean."""
    return 1 if st.config["prescaled_batch"] else st.tp_size


@dataclass(frozen=True)
class Average:
    """Local gradients reduced in place over ``group`` (``None``: no collective): their mean,
    or (``divisor``) their sum divided by it."""

    group: dist.ProcessGroup | None
    divisor: int | None
    grads: list[torch.Tensor]


def averages(params: Sequence[torch.Tensor], st: MPState, rdp_mean_taken: bool) -> list[Average]:
    """How the gradients of ``params`` (the local parts of those that have one) become SMP's
    averages over the data-parallel group.

    A plain parameter saw its rank's batch: the mean over the dp group (rdp x tp). A
    scaled-batch one (with tensor parallelism) holds the sum over :func:`tp_batches` batches:
    the sum over the rdp group divided by the number of distinct batches. ``rdp_mean_taken``:
    the mean over the rdp group is taken already (FSDP2's reduce-scatter), leaving a plain
    gradient's mean over the tp group and a scaled one's division by :func:`tp_batches`."""
    split = st.tp_size > 1
    plain = [local(p.grad) for p in params if p.grad is not None and not _scaled(p, split)]
    scaled = [local(p.grad) for p in params if p.grad is not None and _scaled(p, split)]
    result = []
    if rdp_mean_taken:
        if plain and split:
            result.append(Average(st.tp_process_group, None, plain))
        if scaled and tp_batches(st) > 1:
            result.append(Average(None, tp_batches(st), scaled))
    else:
        if plain:
            result.append(Average(st.dp_process_group, None, plain))
        if scaled:
            result.append(Average(st.rdp_process_group, st.rdp_size * tp_batches(st), scaled))
    return result


def _scaled(param: torch.Tensor, split: bool) -> bool:
    """Whether ``param``'s gradient averages as a scaled-batch one: only where the tp group
    splits the batch (at tp 1 a distributed module's parameters average as plain ones)."""
    return split and is_scaled_batch(param)


def carry_earlier(params: Sequence[torch.Tensor], st: MPState) -> None:
    """Ready the scaled-batch gradients of earlier steps in ``params`` (accumulating before one
    optimizer step, averaged by their own steps, so alike on every rank that averages them) for
    a step that averages them again with this step's: multiplied in place by the
    :func:`tp_batches` the average divides by, so that it leaves them as they were
    (``sum_rdp(t*e + n) / (rdp*t) = e + sum_rdp(n) / (rdp*t)``). No second buffer: a plain
    gradient's mean is linear (``mean(e + n) = e + mean(n)``) and so is a prescaled one's, so
    nothing else is touched. A step that fails leaves them multiplied beside its partial
    gradients: the script zeroes them."""
    factor = tp_batches(st)
    grads = [local(p.grad) for p in params if p.grad is not None and _scaled(p, st.tp_size > 1)]
    if factor > 1 and grads:
        torch._foreach_mul_(grads, factor)

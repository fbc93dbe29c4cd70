"""SMDDP's collective API on torch.distributed: the same names, plus ``ReduceOp.AVERAGE``.

gloo has no average reduction in every torch version, so ``AVERAGE`` is a sum followed by an
in-place division by the group size (NCCL's native ``AVG`` is used when the group is NCCL).
"""

from __future__ import annotations

import enum
from datetime import timedelta

import torch
import torch.distributed as dist

group = dist.group
"""``group.WORLD``, as SMDDP scripts spell the default group."""


class ReduceOp(enum.Enum):
    """The reductions SMDDP offers."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"


_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


class AveragingWork:
    """An async sum that divides its tensor by the group size once it has completed.

    Behaves like ``torch.distributed.Work`` for ``wait`` and ``is_completed``; the division
    happens in the first ``wait``, so the tensor holds the average only after waiting.
    """

    def __init__(self, work: dist.Work, tensor: torch.Tensor, size: int) -> None:
        self._work, self._tensor, self._size = work, tensor, size
        self._divided = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._divided:
            self._tensor.div_(self._size)
            self._divided = True
        return done

    def is_completed(self) -> bool:
        return self._divided or self._work.is_completed()


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | AveragingWork | None:
    """Reduce ``tensor`` in place across the group; ``AVERAGE`` needs a floating-point tensor."""
    if op is not ReduceOp.AVERAGE:
        return dist.all_reduce(tensor, op=_TORCH_OPS[op], group=group, async_op=async_op)
    if not tensor.is_floating_point():
        raise TypeError(f"ReduceOp.AVERAGE needs a floating-point tensor, got {tensor.dtype}")
    if dist.get_backend(group) == dist.Backend.NCCL:
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    size = dist.get_world_size(group)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if work is not None:
        return AveragingWork(work, tensor, size)
    tensor.div_(size)
    return None


def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group."""
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """``tensor_list[i]`` receives group rank i's ``tensor``."""
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_to_all_single(
    output_t: torch.Tensor,
    input_t: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Scatter dim-0 slices of ``input_t`` to every rank and gather theirs into ``output_t``."""
    return dist.all_to_all_single(
        output_t,
        input_t,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=async_op,
    )


def barrier(group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    return dist.barrier(group=group, async_op=async_op)

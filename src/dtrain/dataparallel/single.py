"""torch's single-tensor all-gather and reduce-scatter, under the name the running torch gives
them: torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to
``all_gather_single`` and ``reduce_scatter_single`` (the old names warn there), and the
supported range starts at 2.6, which has only the old ones. Looked up at each call, which
costs an attribute lookup."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(
    output: torch.Tensor,
    local: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Every rank's ``local`` (one size on all), concatenated in group order into ``output``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    whole: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """The group's sum of ``whole``, of which this rank keeps its shard (``output``)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, whole, group=group, async_op=async_op)


def started(work: dist.Work | None) -> dist.Work:
    """The handle of an operation started asynchronously (``async_op=True``, ``isend``): torch
    types it optional, as a rank outside the group gets none, which no caller here is."""
    assert work is not None, "an operation started asynchronously on its group returns its Work"
    return work

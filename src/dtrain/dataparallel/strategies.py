"""How one bucket's wire tensor is summed across ranks: a fixed chain of async collectives.

A strategy splits the all-reduce into stages (one for a flat all-reduce, three for the
hierarchical one, three or four through shared memory). Each stage runs on its own process
group and the reducer issues every stage for chunks in index order, so on every group all ranks
see the same sequence of collectives even though stages of different chunks overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist


@dataclass
class Transfer:
    """One bucket's reduction in flight: the wire tensor, per-strategy scratch, the latest work."""

    wire: torch.Tensor
    scratch: torch.Tensor | None = None
    work: dist.Work | None = None


class BufferSpec(NamedTuple):
    """One bucket's flat buffer: elements (already padded), dtype and device."""

    numel: int
    dtype: torch.dtype
    device: torch.device


class StagedAllReduce(Protocol):
    """Sums ``transfer.wire`` over the data-parallel group, stage by stage.

    ``pad_multiple``: the wire's length must be a multiple of this (the reducer zero-pads).
    ``buffers(specs)`` makes a bucket plan's zeroed flat buffers (a strategy may need them in
    memory it controls); every rank calls it at the same point. ``launch(stage, transfer)``
    starts stage ``stage`` once the previous one has completed and returns its work; after the
    last stage ``transfer.wire`` holds the sum.
    """

    @property
    def num_stages(self) -> int: ...

    @property
    def pad_multiple(self) -> int: ...

    def buffers(self, specs: Sequence[BufferSpec]) -> list[torch.Tensor]: ...

    def launch(self, stage: int, transfer: Transfer) -> dist.Work: ...


def private_buffers(specs: Sequence[BufferSpec]) -> list[torch.Tensor]:
    """Zeroed buffers in the process's own memory: what collectives over a process group use."""
    return [torch.zeros(spec.numel, dtype=spec.dtype, device=spec.device) for spec in specs]


def own_group(
    rank: int, partition: list[list[int]], backend: str | None = None
) -> dist.ProcessGroup:
    """Create every group of a partition (all ranks must) and keep the one holding ``rank``."""
    own: dist.ProcessGroup | None = None
    for ranks in partition:
        created = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            own = created
    assert own is not None, f"rank {rank} is in no group of {partition}"
    return own


@dataclass(frozen=True)
class FlatAllReduce:
    """One all-reduce over the whole group: the choice on one host, or with one process per host."""

    group: dist.ProcessGroup | None
    num_stages: int = 1
    pad_multiple: int = 1
    buffers = staticmethod(private_buffers)

    def launch(self, stage: int, transfer: Transfer) -> dist.Work:
        return dist.all_reduce(transfer.wire, group=self.group, async_op=True)

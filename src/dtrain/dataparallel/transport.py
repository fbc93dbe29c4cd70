"""How one bucket's wire tensor is summed across ranks: a fixed chain of async collectives.

A strategy splits the all-reduce into stages (one for a flat all-reduce, three for the
hierarchical one). Each stage runs on its own process group and the reducer issues every stage
for buckets in index order, so on every group all ranks see the same sequence of collectives
even though stages of different buckets overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


@dataclass
class Transfer:
    """One bucket's reduction in flight: the wire tensor, per-strategy scratch, the latest work."""

    wire: torch.Tensor
    scratch: torch.Tensor | None = None
    work: dist.Work | None = None


class StagedAllReduce(Protocol):
    """Sums ``transfer.wire`` over the data-parallel group, stage by stage.

    ``pad_multiple``: the wire's length must be a multiple of this (the reducer zero-pads).
    ``launch(stage, transfer)`` starts stage ``stage`` once the previous one has completed and
    returns its work; after the last stage ``transfer.wire`` holds the sum.
    """

    @property
    def num_stages(self) -> int: ...

    @property
    def pad_multiple(self) -> int: ...

    def launch(self, stage: int, transfer: Transfer) -> dist.Work: ...


@dataclass(frozen=True)
class FlatAllReduce:
    """One all-reduce over the whole group: the choice on one host, or with one process per host."""

    group: dist.ProcessGroup | None
    num_stages: int = 1
    pad_multiple: int = 1

    def launch(self, stage: int, transfer: Transfer) -> dist.Work:
        return dist.all_reduce(transfer.wire, group=self.group, async_op=True)

"""Where a rank sits in its pipeline: the ranks, the process groups, the device, the timeout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PipelineGroup:
    """Where this rank sits: its pipeline's global ranks (index = pp rank) and process groups."""

    rank: int
    pp_rank: int
    ranks: list[int]
    control_group: dist.ProcessGroup | None
    data_group: dist.ProcessGroup | None
    device: torch.device
    timeout: float

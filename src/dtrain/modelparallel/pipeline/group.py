"""Where a rank sits in its pipeline, and what its caller and owner sides share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dtrain.modelparallel.pipeline.executor import Executor
from dtrain.modelparallel.transport import Transport


@dataclass(frozen=True)
class PipelineGroup:
    """Where this rank sits: its pipeline's global ranks (index = pp rank) and process groups."""

    rank: int
    pp_rank: int
    ranks: list[int]
    message_group: dist.ProcessGroup | None
    """gloo group of the pipeline: every message between its ranks, tensors included."""
    device: torch.device
    timeout: float


@dataclass(frozen=True)
class RankParts:
    """What the caller and owner sides of a rank share: its place, its messaging (None in a
    pipeline of one), its compute token, the model's modules and who owns each."""

    group: PipelineGroup
    transport: Transport | None
    executor: Executor
    modules: dict[str, nn.Module]
    owners: dict[str, int]

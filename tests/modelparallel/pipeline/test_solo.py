"""Waiting for rank 0's profiling and planning as long as it works, not ``DTRAIN_MP_TIMEOUT``."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import CommunicationTimeoutError
from dtrain.modelparallel.pipeline import solo
from tests.modelparallel.harness import run_ranks, sum_step

TIMEOUT_S = 3.0
PROFILING_S = 4.5
"""Rank 0's profiling step: longer than any wait for a peer may last."""


class SlowToProfile(nn.Module):
    """Its first call on rank 0, the profiling step's, takes ``PROFILING_S``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.profiled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if smp.rank() == 0 and not self.profiled:
            time.sleep(PROFILING_S)
            self.profiled = True
        return self.second(self.first(x))


def _partition_slowly() -> float:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": True})
    model = smp.DistributedModel(SlowToProfile())
    return float(sum_step()(model, torch.ones(2, 4)).reduce_mean())


def test_ranks_wait_for_a_profiling_step_longer_than_the_timeout() -> None:
    losses = run_ranks(2, _partition_slowly, env={"DTRAIN_MP_TIMEOUT": str(TIMEOUT_S)})
    assert losses[0] == losses[1]


def test_the_wait_ends_with_the_work_and_fails_without_beats() -> None:
    store = dist.HashStore()
    with solo.working(store, "quick", TIMEOUT_S):
        pass
    solo.wait_for(store, "quick", TIMEOUT_S, 1, "rank 0's quick work")  # done: no wait
    with pytest.raises(CommunicationTimeoutError, match="rank 1: waiting for rank 0's plan: no"):
        solo.wait_for(store, "gone", 0.3, 1, "rank 0's plan")  # nobody beats under this name

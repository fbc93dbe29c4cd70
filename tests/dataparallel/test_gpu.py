"""Data parallelism on NCCL, run where GPUs are (skipped elsewhere): the hierarchical reduction
with bf16 compression on its own CUDA stream, against the exact average and torch's DDP with its
bf16 compression hook, under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which checks that every rank
issues the same collectives in the same order). On 4 GPUs, 2 hosts of 2; on fewer, one NCCL rank
(NCCL refuses two ranks on one GPU) with the hierarchical path forced: its three stages run on
groups of one, on the reducer's stream, and compression loses what it loses with more."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dataparallel import scenarios
from tests.dataparallel.ranks import run_pool
from tests.dataparallel.test_equivalence import check_compressed, max_diff

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_hierarchical_bf16_on_nccl_trains_as_torch_ddp_does(tmp_path: Path) -> None:
    world, local_size = (4, 2) if torch.cuda.device_count() >= 4 else (1, 1)
    results = run_pool(
        [scenarios.gpu_bf16],
        world=world,
        local_size=local_size,
        out=tmp_path,
        backend="nccl",
        environment={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    )
    ours = [{"bf16": result["gpu_bf16"]} for result in results]
    assert all(result["bf16"]["hierarchical"] for result in ours)
    allowed = check_compressed(ours, "bf16")
    reference = scenarios.reference_global(world=world)
    for result in results:
        assert max_diff(result["gpu_bf16"]["torch"], reference) <= allowed

"""Joining a job launched by mpirun (only OMPI_COMM_WORLD_* set), in a world of one process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtrain.dataparallel import (
    DistributedDataParallel,
    ReduceOp,
    all_reduce,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
)
from tests.dataparallel import scenarios
from tests.dataparallel.ranks import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def mpirun_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert not is_initialized()
    init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_mpi_environment_is_enough(mpirun_world: None) -> None:
    assert is_initialized()
    init_process_group()  # already joined: a no-op
    assert (get_rank(), get_world_size(), get_local_rank(), get_local_size()) == (0, 1, 0, 1)
    tensor = torch.tensor([3.0])
    all_reduce(tensor, ReduceOp.AVERAGE)
    assert tensor.item() == 3.0


def test_one_rank_trains_like_one_process(mpirun_world: None) -> None:
    model = DistributedDataParallel(scenarios.mlp(scenarios.ROOT_SEED), bucket_cap_mb=0.001)
    optimizer = torch.optim.SGD(model.parameters(), lr=scenarios.LR)
    for step in range(scenarios.STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(scenarios.batch(step, 0)[0]), scenarios.batch(step, 0)[1]).backward()
        optimizer.step()
    reference = scenarios.reference_global(world=1)
    assert all(
        torch.allclose(p, reference[name], atol=1e-6) for name, p in model.module.named_parameters()
    )


def test_local_size_must_divide_the_world(
    mpirun_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=2"):
        get_local_size()

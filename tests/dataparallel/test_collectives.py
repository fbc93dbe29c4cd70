"""SMDDP's collectives and rank queries, on 2 ranks and on 2 hosts of 2 ranks; the single-tensor
collectives under either of torch's names."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtrain.dataparallel import single
from dtrain.modelparallel.tensor import batch
from tests.dataparallel.conftest import Results

pytestmark = pytest.mark.timeout(180)


def check_collectives(results: Results, local_size: int) -> None:
    world = len(results)
    total = world * (world + 1) / 2  # ranks contribute 1..world
    for rank, result in enumerate(results):
        out = result["collectives"]
        assert torch.equal(out["SUM"], torch.tensor([total, -total]))
        assert torch.allclose(out["AVERAGE"], torch.tensor([total / world, -total / world]))
        assert torch.allclose(out["AVERAGE_async"], torch.tensor([total / world]))
        assert torch.equal(out["MIN"], torch.tensor([1.0, -float(world)]))
        assert torch.equal(out["MAX"], torch.tensor([float(world), -1.0]))
        assert out["int_average"] == "rejected"
        assert torch.equal(out["broadcast"], torch.full((3,), float(world - 1)))
        expected_gather = torch.tensor([[float(r), 10.0 * r] for r in range(world)])
        assert torch.equal(out["all_gather"], expected_gather)
        assert torch.equal(
            out["all_to_all"], torch.tensor([100.0 * r + rank for r in range(world)])
        )
        assert out["layout"] == (rank, world, rank % local_size, local_size)
        assert out["available"] == (True, True)


def test_collectives_two_ranks(two_ranks: Results) -> None:
    check_collectives(two_ranks, local_size=2)


def test_collectives_two_hosts(two_hosts: Results) -> None:
    check_collectives(two_hosts, local_size=2)


@pytest.mark.filterwarnings("ignore:`torch.distributed.*` is deprecated:FutureWarning")
@pytest.mark.parametrize("names", ["torch 2.13's", "older"])
def test_single_tensor_collectives_run_under_either_of_torchs_names(
    names: str, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.13 named them ``all_gather_single`` and ``reduce_scatter_single``; the supported
    range starts at 2.6, which has only ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
    (the hierarchical reducer's stages and a tp region's gather)."""
    if names == "older":
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
        monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    local = torch.tensor([1.0, 2.0])
    gathered = torch.empty(2)
    single.all_gather_single(gathered, local)
    summed = torch.empty(2)
    single.reduce_scatter_single(summed, local)
    assert torch.equal(gathered, local) and torch.equal(summed, local)
    rows = torch.ones(1, 3)
    assert torch.equal(batch._all_gather(rows, dist.group.WORLD), rows)

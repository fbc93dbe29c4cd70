"""``shared_memory=True``: reduction through /dev/shm inside a host equals single-process training.

The runs share the pools of test_equivalence (same tiny cap, so buckets are several and the
hierarchical runs split a bucket into chunks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain.dataparallel.ddp import _shared_memory_obstacle
from dtrain.dataparallel.shm import SHM_DIR, SHM_ENV, wants_shared_memory
from tests.dataparallel import scenarios
from tests.dataparallel.conftest import Results
from tests.dataparallel.test_equivalence import assert_all_ranks_match, check_compressed

pytestmark = pytest.mark.timeout(180)


def test_env_var_turns_it_on_and_the_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHM_ENV, raising=False)
    assert not wants_shared_memory(None)
    monkeypatch.setenv(SHM_ENV, "1")
    assert wants_shared_memory(None)
    assert not wants_shared_memory(False)
    monkeypatch.setenv(SHM_ENV, "0")
    assert not wants_shared_memory(None)
    assert wants_shared_memory(True)


def test_obstacles_known_without_asking_other_ranks() -> None:
    cpu = [nn.Parameter(torch.zeros(2))]
    assert _shared_memory_obstacle(True, 2, 2, cpu) is None
    assert "spanning all ranks" in str(_shared_memory_obstacle(False, 2, 2, cpu))
    assert "hierarchical=False" in str(_shared_memory_obstacle(True, 4, 2, cpu))
    meta = [nn.Parameter(torch.zeros(2, device="meta"))]
    assert "CPU gradients" in str(_shared_memory_obstacle(True, 2, 2, meta))


def assert_identical_across_ranks(results: Results, scenario: str) -> None:
    """Each shard is summed by one rank and copied by the others: bit-identical replicas."""
    first = results[0][scenario]["params"]
    for result in results[1:]:
        assert all(torch.equal(first[name], result[scenario]["params"][name]) for name in first)


def assert_nothing_left(results: Results, scenario: str) -> None:
    for result in results:
        pid = result[scenario]["pid"]
        assert not list(Path(SHM_DIR).glob(f"dtrain-{pid}-*")), "segments must be unlinked"


@pytest.mark.parametrize("scenario", ["shm_plain", "shm_bucket_view"])
def test_one_host(two_ranks: Results, scenario: str) -> None:
    assert_all_ranks_match(two_ranks, scenario, scenarios.reference_global(world=2))
    assert_identical_across_ranks(two_ranks, scenario)
    assert_nothing_left(two_ranks, scenario)
    for result in two_ranks:
        assert result[scenario]["shared_memory"] and not result[scenario]["hierarchical"]
        assert result[scenario]["grads_are_views"] == (scenario == "shm_bucket_view")


def test_two_hosts(two_hosts: Results) -> None:
    assert_all_ranks_match(two_hosts, "shm_plain", scenarios.reference_global(world=4))
    assert_identical_across_ranks(two_hosts, "shm_plain")
    assert_nothing_left(two_hosts, "shm_plain")
    assert all(
        r["shm_plain"]["shared_memory"] and r["shm_plain"]["hierarchical"] for r in two_hosts
    )


def test_two_hosts_compressed_across_hosts(two_hosts: Results) -> None:
    """Within fp16 compression's bound (fewer roundings than a 16-bit ring: it holds a fortiori)."""
    check_compressed([{"fp16": result["shm_fp16"]} for result in two_hosts], "fp16")

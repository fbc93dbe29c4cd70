"""Two shared worlds for the multi-process tests (2 ranks on one host, 2 hosts of 2 ranks), and a
world of one in the test's own process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.dataparallel import scenarios
from tests.dataparallel.ranks import run_pool

Results = list[dict[str, dict[str, Any]]]


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out: Path = tmp_path_factory.mktemp("two_ranks")
    return run_pool(scenarios.TWO_RANKS, world=2, local_size=2, out=out)


@pytest.fixture(scope="session")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out: Path = tmp_path_factory.mktemp("two_hosts")
    return run_pool(scenarios.TWO_HOSTS_OF_TWO, world=4, local_size=2, out=out)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

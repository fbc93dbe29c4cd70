"""Per-rank shares of a dataset: equal lengths, disjoint, deterministic per epoch."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.dataparallel import ShardedSampler, shard_files


def shares(length: int, world: int, **options: object) -> list[list[int]]:
    samplers = [ShardedSampler(length, rank=r, world=world, **options) for r in range(world)]
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("length", [12, 13, 3])
def test_shares_cover_the_dataset_with_equal_lengths(length: int) -> None:
    parts = shares(length, world=4, seed=7)
    assert len({len(part) for part in parts}) == 1
    assert all(len(part) == len(ShardedSampler(length, 0, 4)) for part in parts)
    seen = [index for part in parts for index in part]
    assert set(seen) == set(range(length))
    assert len(seen) - length == (-length) % 4, "only the padding repeats"


def test_drop_last_gives_disjoint_equal_shares() -> None:
    parts = shares(13, world=4, drop_last=True)
    assert [len(part) for part in parts] == [3, 3, 3, 3]
    seen = [index for part in parts for index in part]
    assert len(seen) == len(set(seen)) == 12


def test_epochs_reshuffle_deterministically() -> None:
    sampler = ShardedSampler(100, rank=1, world=2, seed=3)
    first = list(sampler)
    assert list(sampler) == first, "same epoch, same order"
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    again = ShardedSampler(100, rank=1, world=2, seed=3)
    again.set_epoch(1)
    assert list(again) == second, "another process computes the same permutation"
    assert list(ShardedSampler(100, rank=1, world=2, seed=4)) != first


def test_no_shuffle_is_strided() -> None:
    assert shares(6, world=2, shuffle=False) == [[0, 2, 4], [1, 3, 5]]


def test_defaults_to_a_single_process_without_a_group() -> None:
    sampler = ShardedSampler(5, shuffle=False)
    assert (sampler.rank, sampler.world, list(sampler)) == (0, 1, [0, 1, 2, 3, 4])


def test_invalid_rank() -> None:
    with pytest.raises(ValueError):
        ShardedSampler(10, rank=2, world=2)


def test_shard_files_is_order_independent_and_disjoint() -> None:
    files = [f"part-{i:03d}" for i in range(7)]
    listing = list(reversed(files))
    parts = [shard_files(listing, rank, 3) for rank in range(3)]
    assert parts[0] == ["part-000", "part-003", "part-006"]
    assert sorted(name for part in parts for name in part) == files
    paths = [Path(f) for f in files]
    assert shard_files(paths, 1, 3) == [Path("part-001"), Path("part-004")]


def test_shard_files_needs_a_file_per_rank() -> None:
    with pytest.raises(ValueError, match="2 files"):
        shard_files(["a", "b"], 0, 3)

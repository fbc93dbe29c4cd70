"""Splitting data between ranks: sample indices per epoch, or whole files.

Every rank must run the same number of steps (a rank that stops early leaves the others waiting
in an all-reduce), so shares are equal in length: ``drop_last`` drops the tail that does not
divide evenly, otherwise the tail is padded by repeating indices from the start, and at most
``world - 1`` samples are then seen twice per epoch. Apart from that padding, shares are disjoint.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
from torch.utils.data import Sampler

from dtrain.dataparallel.process_group import get_rank, get_world_size, is_initialized

PathT = TypeVar("PathT", str, os.PathLike[str])


def _rank_and_world(rank: int | None, world: int | None) -> tuple[int, int]:
    """Explicit values, else the process group's, else a single process."""
    if world is None:
        world = get_world_size() if is_initialized() else 1
    if rank is None:
        rank = get_rank() if is_initialized() else 0
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    return rank, world


class ShardedSampler(Sampler[int]):
    """Rank ``rank``'s share of ``range(dataset_len)``, reshuffled per epoch with ``set_epoch``.

    The permutation depends only on ``seed`` and the epoch, so every rank draws the same one and
    takes every ``world``-th index of it: shares are disjoint and together cover the dataset.
    """

    def __init__(
        self,
        dataset_len: int,
        rank: int | None = None,
        world: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be non-negative, got {dataset_len}")
        self.rank, self.world = _rank_and_world(rank, world)
        self.dataset_len = dataset_len
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        divide = math.floor if drop_last else math.ceil
        self.num_samples = divide(dataset_len / self.world)

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch``; call it before iterating each epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            indices = list(range(self.dataset_len))
        total = self.num_samples * self.world
        if total > len(indices) and indices:
            repeats = math.ceil(total / len(indices))
            indices = (indices * repeats)[:total]
        return iter(indices[self.rank : total : self.world])


def shard_files(
    files: Sequence[PathT], rank: int | None = None, world: int | None = None
) -> list[PathT]:
    """Rank ``rank``'s share of ``files``: every ``world``-th of them in sorted order.

    Sorting makes the split the same on every rank whatever order the listing came in.
    Raises ValueError when there are fewer files than ranks (some ranks would get no data).
    """
    rank, world = _rank_and_world(rank, world)
    if len(files) < world:
        raise ValueError(f"{len(files)} files cannot be split over {world} ranks")
    return sorted(files, key=os.fspath)[rank::world]

"""Where each rank sits in SMP v2's layout, and its groups: pure arithmetic, no processes.

The world is a grid of four dimensions, the last varying fastest over neighbouring ranks::

    rank = ((replicate * shard_degree + shard) * cp_degree + cp) * tp_degree + tp

* ``tp``: ranks splitting each transformed layer's weights (``tensor_parallel_degree``);
* ``cp``: ranks splitting each sequence (``context_parallel_degree``); they hold the same
  parameters, so FSDP shards over them too;
* ``shard``: the other ranks a parameter is sharded over: ``shard_degree`` x ``cp_degree`` is the
  hybrid shard degree, the ranks of one FSDP shard group (:meth:`Layout.hybrid_shard_group`);
* ``replicate``: the shard groups, which hold replicas of one another (hybrid sharding).

So the ranks of one tp group, and of one cp x tp block, are consecutive, as AWS's scripts assume
when they compute their data-parallel rank as ``rank // (tp * cp)``; ranks with the same
``(replicate, shard)`` read the same batch. SMP calls the replicate groups replication groups
(:meth:`Layout.get_rep_rank`, :meth:`Layout.get_rep_groups`: ``tsm.state.ranker``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from dtrain.config.smpv2 import check_world_size, hybrid_shard_extent

Dimension = Literal["replicate", "shard", "cp", "tp"]
DIMENSIONS: tuple[Dimension, ...] = get_args(Dimension)

GroupKind = Literal[Dimension, "hybrid_shard", "data"]
"""A line of the grid along one dimension, or along two neighbouring ones: ``hybrid_shard`` is
shard x cp (FSDP's shard group), ``data`` is replicate x shard (ranks reading different batches)."""

_VARYING: dict[str, tuple[Dimension, ...]] = {
    **{dim: (dim,) for dim in DIMENSIONS},
    "hybrid_shard": ("shard", "cp"),
    "data": ("replicate", "shard"),
}


@dataclass(frozen=True)
class Layout:
    """The grid of ``world_size`` ranks for tensor degree ``tp``, context degree ``cp`` and
    ``hybrid_shard`` ranks per shard group (the resolved hybrid shard degree, never 0)."""

    world_size: int
    tp: int = 1
    cp: int = 1
    hybrid_shard: int = 1

    def __post_init__(self) -> None:
        slice_ranks, rest = divmod(self.world_size, self.tp)
        if rest or slice_ranks % self.hybrid_shard or self.hybrid_shard % self.cp:
            raise ValueError(f"{self} does not tile its world (see check_world_size)")

    @classmethod
    def of(cls, values: Mapping[str, Any], world_size: int, where: str = "parameters") -> Layout:
        """The layout SMP v2 parameters ``values`` (validated) give ``world_size`` ranks."""
        check_world_size(values, world_size, where)
        return cls(
            world_size,
            tp=int(values["tensor_parallel_degree"]),
            cp=int(values["context_parallel_degree"]),
            hybrid_shard=hybrid_shard_extent(values, world_size),
        )

    @property
    def shape(self) -> dict[Dimension, int]:
        """Each dimension's size, in grid order."""
        replicate = self.world_size // (self.tp * self.hybrid_shard)
        return {
            "replicate": replicate,
            "shard": self.hybrid_shard // self.cp,
            "cp": self.cp,
            "tp": self.tp,
        }

    def coords(self, rank: int) -> dict[Dimension, int]:
        """``rank``'s index along each dimension."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        found: dict[Dimension, int] = {}
        for dim in reversed(DIMENSIONS):
            rank, found[dim] = divmod(rank, self.shape[dim])
        return {dim: found[dim] for dim in DIMENSIONS}

    def rank_of(self, coords: Mapping[Dimension, int]) -> int:
        rank = 0
        for dim in DIMENSIONS:
            rank = rank * self.shape[dim] + coords[dim]
        return rank

    def group(self, kind: GroupKind, rank: int) -> list[int]:
        """The ranks of ``rank``'s group of ``kind``: those differing from it only along the
        dimensions ``kind`` varies, in rank order."""
        return next(members for members in self.groups(kind) if rank in members)

    def groups(self, kind: GroupKind) -> list[list[int]]:
        """Every group of ``kind``, each in rank order, ordered by their first rank: together
        they partition the world."""
        varying = _VARYING[kind]
        lines: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coords(rank)
            fixed = tuple(coords[dim] for dim in DIMENSIONS if dim not in varying)
            lines.setdefault(fixed, []).append(rank)
        return sorted(lines.values())

    def index(self, kind: GroupKind, rank: int) -> int:
        """``rank``'s index in its group of ``kind`` (what torch.distributed calls its group
        rank there)."""
        return self.group(kind, rank).index(rank)

    # SMP's ranker (tsm.state.ranker), as AWS's checkpointing code calls it.

    def get_rep_rank(self, rank: int) -> int:
        """Which replica of its shard ``rank`` holds (0 for the first shard group)."""
        return self.coords(rank)["replicate"]

    def get_rep_groups(self) -> list[list[int]]:
        """The replication groups: the ranks holding the same shard, one from each shard
        group."""
        return self.groups("replicate")

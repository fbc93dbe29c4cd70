"""Rank layout for SMP-v1-style model parallelism: which rank holds which partition, and its groups.

The world is ``num_hosts × processes_per_host`` ranks, split into pipeline (P), tensor (T) and
reduced-data-parallel (D) dimensions. A placement strategy orders the three letters as the digits
of a mixed-radix number: for placement ``"XYZ"``, ``rank = x*|Y|*|Z| + y*|Z| + z``, so the
right-most letter is the parallelism over neighbouring ranks (SageMaker: ``cluster`` ≡ ``"DPT"``,
``spread`` ≡ ``"TPD"``).

Groups follow SMP v1: the pp group varies P only, tp varies T, rdp varies D, the dp group (ranks
holding the same partition) varies D and T, and the mp group (one full model replica) varies P and
T. Every ``*_rank`` is the index in the group's sorted rank list, which is what
``torch.distributed.new_group`` reports as the group rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal, get_args

from dtrain.errors import ConfigError, did_you_mean

PLACEMENT_ALIASES: dict[str, str] = {"cluster": "DPT", "spread": "TPD"}
"""SageMaker's named placements and the letter order each stands for."""

PLACEMENT_ORDERS: tuple[str, ...] = tuple("".join(p) for p in itertools.permutations("DPT"))
"""Every letter order a placement may name directly."""

GroupKind = Literal["pp", "tp", "dp", "rdp", "mp", "host", "cross_host"]
GROUP_KINDS: tuple[GroupKind, ...] = get_args(GroupKind)

# Which mixed-radix letters vary inside a group of each model-parallel kind.
_VARYING: dict[str, str] = {"pp": "P", "tp": "T", "rdp": "D", "dp": "DT", "mp": "PT"}


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits: its host and its index in each of its groups."""

    rank: int
    host: int
    local_rank: int
    pp_rank: int
    tp_rank: int
    rdp_rank: int
    dp_rank: int
    mp_rank: int

    @property
    def host_name(self) -> str:
        """SageMaker's name for this rank's host (``algo-1`` is host 0)."""
        return host_name(self.host)


def host_name(host: int) -> str:
    """SageMaker's host naming: hosts are ``algo-1`` … ``algo-N``."""
    return f"algo-{host + 1}"


def placement_order(placement: str) -> str:
    """The letter order (e.g. ``"DPT"``) a placement names; raises ConfigError if it is invalid."""
    if isinstance(placement, str):
        order = PLACEMENT_ALIASES.get(placement, placement)
        if order in PLACEMENT_ORDERS:
            return order
    candidates = [*PLACEMENT_ALIASES, *PLACEMENT_ORDERS]
    suggestion = None
    if isinstance(placement, str):
        upper = placement.upper()
        suggestion = upper if upper in PLACEMENT_ORDERS else did_you_mean(placement, candidates)
    raise ConfigError(
        "placement_strategy",
        placement,
        "'cluster' (= 'DPT'), 'spread' (= 'TPD') or a permutation of the letters D, P, T: "
        + ", ".join(PLACEMENT_ORDERS),
        suggestion,
    )


def _check_positive(key: str, value: object) -> None:
    # bool is an int subclass; True as a degree is almost certainly a mistake.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(key, value, "a positive integer")


@dataclass(frozen=True)
class Topology:
    """Maps every rank of a world to its coordinates and groups under a placement strategy.

    ``world_size`` must be a multiple of ``processes_per_host`` (hosts are filled in rank order)
    and of ``pipeline_degree * tensor_degree``; the remaining factor is the rdp degree.
    """

    world_size: int
    processes_per_host: int
    pipeline_degree: int = 1
    tensor_degree: int = 1
    placement: str = "cluster"

    def __post_init__(self) -> None:
        _check_positive("world_size", self.world_size)
        _check_positive("processes_per_host", self.processes_per_host)
        _check_positive("pipeline_parallel_degree", self.pipeline_degree)
        _check_positive("tensor_parallel_degree", self.tensor_degree)
        if self.world_size % self.processes_per_host:
            raise ConfigError(
                "processes_per_host",
                self.processes_per_host,
                f"a divisor of the world size {self.world_size} (every host runs as many ranks)",
            )
        model = self.pipeline_degree * self.tensor_degree
        if self.world_size % model:
            raise ConfigError(
                "pipeline_parallel_degree",
                self.pipeline_degree,
                f"pipeline_parallel_degree × tensor_parallel_degree (here {model}) must divide "
                f"the world size {self.world_size}",
            )
        placement_order(self.placement)

    # --- sizes -------------------------------------------------------------------------------

    @property
    def order(self) -> str:
        """The placement as a letter order, e.g. ``"DPT"`` for ``cluster``."""
        return placement_order(self.placement)

    @property
    def rdp_degree(self) -> int:
        """Model replicas per tensor slice: world / (pp × tp)."""
        return self.world_size // (self.pipeline_degree * self.tensor_degree)

    @property
    def dp_degree(self) -> int:
        """Ranks holding the same pipeline partition: rdp × tp."""
        return self.rdp_degree * self.tensor_degree

    @property
    def mp_degree(self) -> int:
        """Ranks forming one model replica: pp × tp."""
        return self.pipeline_degree * self.tensor_degree

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.processes_per_host

    @property
    def host_names(self) -> list[str]:
        return [host_name(h) for h in range(self.num_hosts)]

    # --- mixed radix -------------------------------------------------------------------------

    def _sizes(self) -> dict[str, int]:
        return {"D": self.rdp_degree, "P": self.pipeline_degree, "T": self.tensor_degree}

    def _strides(self) -> dict[str, int]:
        sizes = self._sizes()
        strides: dict[str, int] = {}
        stride = 1
        for letter in reversed(self.order):
            strides[letter] = stride
            stride *= sizes[letter]
        return strides

    def _digits(self, rank: int) -> dict[str, int]:
        self._check_rank(rank)
        sizes, strides = self._sizes(), self._strides()
        return {letter: (rank // strides[letter]) % sizes[letter] for letter in "DPT"}

    def _compose(self, digits: dict[str, int]) -> int:
        strides = self._strides()
        return sum(digits[letter] * strides[letter] for letter in "DPT")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    # --- ranks and groups --------------------------------------------------------------------

    def rank_of(self, pp_rank: int, tp_rank: int = 0, rdp_rank: int = 0) -> int:
        """The global rank at these coordinates (inverse of ``coords``)."""
        for name, value, size in (
            ("pp_rank", pp_rank, self.pipeline_degree),
            ("tp_rank", tp_rank, self.tensor_degree),
            ("rdp_rank", rdp_rank, self.rdp_degree),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{name} {value} is outside 0..{size - 1}")
        return self._compose({"D": rdp_rank, "P": pp_rank, "T": tp_rank})

    def group(self, kind: GroupKind, rank: int) -> list[int]:
        """Sorted global ranks of ``rank``'s group of this kind."""
        self._check_rank(rank)
        if kind == "host":
            first = rank - rank % self.processes_per_host
            return list(range(first, first + self.processes_per_host))
        if kind == "cross_host":
            return list(
                range(rank % self.processes_per_host, self.world_size, self.processes_per_host)
            )
        if kind not in _VARYING:
            raise ValueError(f"unknown group kind {kind!r}; known: {', '.join(GROUP_KINDS)}")
        varying = _VARYING[kind]
        sizes, fixed = self._sizes(), self._digits(rank)
        ranges = [range(sizes[letter]) for letter in varying]
        members = (
            self._compose({**fixed, **dict(zip(varying, values, strict=True))})
            for values in itertools.product(*ranges)
        )
        return sorted(members)

    def pp_group(self, rank: int) -> list[int]:
        """Pipeline stages of one model replica (same rdp and tp)."""
        return self.group("pp", rank)

    def tp_group(self, rank: int) -> list[int]:
        """Ranks splitting the same layers (same rdp and pp)."""
        return self.group("tp", rank)

    def rdp_group(self, rank: int) -> list[int]:
        """Replicas of the same tensor slice of the same partition (same pp and tp)."""
        return self.group("rdp", rank)

    def dp_group(self, rank: int) -> list[int]:
        """Ranks holding the same pipeline partition (same pp); gradients reduce here."""
        return self.group("dp", rank)

    def mp_group(self, rank: int) -> list[int]:
        """One whole model replica (same rdp)."""
        return self.group("mp", rank)

    def host_group(self, rank: int) -> list[int]:
        """Ranks on the same host as ``rank``."""
        return self.group("host", rank)

    def cross_host_group(self, rank: int) -> list[int]:
        """Ranks with the same local_rank as ``rank``, one per host."""
        return self.group("cross_host", rank)

    def all_groups(self, kind: GroupKind) -> list[list[int]]:
        """Every group of a kind, each sorted, ordered by first rank.

        ``torch.distributed.new_group`` must be called by every rank for every group in the same
        order, so each rank needs the whole list, not just its own group.
        """
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            members = self.group(kind, rank)
            seen.setdefault(members[0], members)
        return [seen[first] for first in sorted(seen)]

    def coords(self, rank: int) -> RankCoords:
        """``rank``'s host, local rank and index in each of its groups."""
        digits = self._digits(rank)
        return RankCoords(
            rank=rank,
            host=rank // self.processes_per_host,
            local_rank=rank % self.processes_per_host,
            pp_rank=digits["P"],
            tp_rank=digits["T"],
            rdp_rank=digits["D"],
            dp_rank=self.dp_group(rank).index(rank),
            mp_rank=self.mp_group(rank).index(rank),
        )

    def table(self) -> str:
        """One line per rank with its host and group ranks, for logs and ``--dry-run`` output."""
        header = ("rank", "host", "local_rank", "pp", "tp", "rdp", "dp", "mp")
        rows: list[tuple[str, ...]] = [header]
        for rank in range(self.world_size):
            c = self.coords(rank)
            rows.append(
                tuple(
                    str(v)
                    for v in (
                        rank,
                        c.host_name,
                        c.local_rank,
                        c.pp_rank,
                        c.tp_rank,
                        c.rdp_rank,
                        c.dp_rank,
                        c.mp_rank,
                    )
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        title = (
            f"placement {self.placement} ({self.order}): {self.num_hosts} host(s) × "
            f"{self.processes_per_host}, pp={self.pipeline_degree} tp={self.tensor_degree} "
            f"rdp={self.rdp_degree}"
        )
        lines = [
            "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        return "\n".join([title, *lines])

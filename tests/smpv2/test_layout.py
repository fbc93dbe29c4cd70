"""SMP v2's rank layout as tables, without processes: the grid (replicate, shard, cp, tp) with tp
varying fastest, so AWS's scripts' ``dp_rank = rank // (tp * cp)`` holds in every layout."""

from __future__ import annotations

import itertools

import pytest

from dtrain.config.smpv2 import validate_smp_v2_parameters
from dtrain.errors import ConfigError
from dtrain.smpv2.layout import DIMENSIONS, Layout

# World 12, tp 2, hybrid shard degree 3 (cp 1): 2 replicas of 3 shards. Each rank's
# "replicate shard cp tp" digits, rank 0 to 11.
COORDS = "0000 0001 0100 0101 0200 0201 1000 1001 1100 1101 1200 1201"


def test_rank_to_coordinates() -> None:
    layout = Layout(12, tp=2, cp=1, hybrid_shard=3)
    assert layout.shape == {"replicate": 2, "shard": 3, "cp": 1, "tp": 2}
    digits = ["".join(str(layout.coords(r)[d]) for d in DIMENSIONS) for r in range(12)]
    assert " ".join(digits) == COORDS
    assert all(layout.rank_of(layout.coords(r)) == r for r in range(12))


# World 8 as AWS's Llama context-parallel notebook lays it out (tp 2, cp 2, hybrid shard 4).
GROUPS = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "shard": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "hybrid_shard": [[0, 2, 4, 6], [1, 3, 5, 7]],  # FSDP's shard groups: shard x cp
    "replicate": [[r] for r in range(8)],
    "data": [[0, 4], [1, 5], [2, 6], [3, 7]],  # ranks reading different batches
}


@pytest.mark.parametrize("kind", sorted(GROUPS))
def test_groups_of_the_context_parallel_layout(kind: str) -> None:
    layout = Layout(8, tp=2, cp=2, hybrid_shard=4)
    assert layout.groups(kind) == GROUPS[kind]  # type: ignore[arg-type]
    for members in GROUPS[kind]:
        for rank in members:
            assert layout.group(kind, rank) == members  # type: ignore[arg-type]


def test_replication_groups_as_smps_ranker_names_them() -> None:
    """World 16, tp 2, hybrid shard 4: two replicas; the first holds ranks 0 to 7."""
    layout = Layout(16, tp=2, cp=1, hybrid_shard=4)
    assert layout.groups("hybrid_shard") == [
        [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15],
    ]  # fmt: skip
    assert layout.get_rep_groups() == [[r, r + 8] for r in range(8)]
    assert [layout.get_rep_rank(r) for r in range(16)] == [0] * 8 + [1] * 8


def _layouts(max_world: int) -> list[Layout]:
    found = []
    for world in range(1, max_world + 1):
        for tp, cp, hybrid in itertools.product(range(1, world + 1), repeat=3):
            if world % tp == 0 and (world // tp) % hybrid == 0 and hybrid % cp == 0:
                found.append(Layout(world, tp=tp, cp=cp, hybrid_shard=hybrid))
    return found


def test_every_layout_keeps_the_scripts_data_parallel_rank() -> None:
    """In every layout of up to 12 ranks, every group kind partitions the world into groups of
    its size; a rank's index among the ranks reading different batches is ``rank // (tp * cp)``;
    tp groups and cp x tp blocks are consecutive ranks."""
    for layout in _layouts(12):
        shape, world, block = layout.shape, layout.world_size, layout.tp * layout.cp
        sizes = {**shape, "hybrid_shard": shape["shard"] * shape["cp"]}
        sizes["data"] = shape["replicate"] * shape["shard"]
        for kind, size in sizes.items():
            groups = layout.groups(kind)  # type: ignore[arg-type]
            assert sorted(r for g in groups for r in g) == list(range(world)), (layout, kind)
            assert {len(g) for g in groups} == {size}, (layout, kind)
        for rank in range(world):
            assert layout.index("data", rank) == rank // block, (layout, rank)
            first = rank - rank % layout.tp
            assert layout.group("tp", rank) == list(range(first, first + layout.tp)), layout
            first = rank - rank % block
            together = {*layout.group("tp", rank), *layout.group("cp", rank)}
            assert together <= set(range(first, first + block)), (layout, rank)


def test_layout_of_the_parameters() -> None:
    values = validate_smp_v2_parameters({"tensor_parallel_degree": 2})
    assert Layout.of(values, 8) == Layout(8, tp=2, cp=1, hybrid_shard=4)  # 0: world / tp
    with pytest.raises(ConfigError, match="hybrid_shard_degree: got 3"):
        Layout.of({**values, "hybrid_shard_degree": 3}, 8)
    with pytest.raises(ValueError, match="does not tile"):
        Layout(8, tp=2, cp=1, hybrid_shard=3)

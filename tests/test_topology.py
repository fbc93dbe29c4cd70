"""Rank placement and groups: SageMaker's documented examples, then invariants over many shapes."""

from __future__ import annotations

import pytest

from dtrain.errors import ConfigError
from dtrain.topology import (
    GROUP_KINDS,
    PLACEMENT_ALIASES,
    PLACEMENT_ORDERS,
    GroupKind,
    Topology,
    placement_order,
)

# (world_size, processes_per_host, pipeline_degree, tensor_degree)
SHAPES = [
    (1, 1, 1, 1),
    (8, 8, 2, 1),
    (8, 4, 2, 2),
    (8, 2, 1, 1),
    (16, 4, 2, 2),
    (24, 8, 2, 3),
    (12, 3, 3, 1),
    (32, 8, 4, 2),
]
PLACEMENTS = [*PLACEMENT_ALIASES, *PLACEMENT_ORDERS]


# --- SageMaker's documented examples (SDK docs, "ranking" section) ---------------------------


def test_spread_example() -> None:
    topo = Topology(8, 8, pipeline_degree=2, placement="spread")
    assert topo.all_groups("mp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.all_groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_cluster_example() -> None:
    topo = Topology(8, 8, pipeline_degree=2, placement="cluster")
    assert topo.all_groups("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.all_groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_default_placement_is_cluster() -> None:
    assert Topology(8, 8, pipeline_degree=2).all_groups("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("placement", ["DPT", "cluster"])
def test_dpt_example(placement: str) -> None:
    topo = Topology(8, 8, pipeline_degree=2, tensor_degree=2, placement=placement)
    for r in range(8):
        c = topo.coords(r)
        assert (c.rdp_rank, c.pp_rank, c.tp_rank) == (r // 4, (r // 2) % 2, r % 2)


def test_ptd_example() -> None:
    topo = Topology(8, 8, pipeline_degree=2, tensor_degree=2, placement="PTD")
    for r in range(8):
        c = topo.coords(r)
        assert (c.rdp_rank, c.tp_rank, c.pp_rank) == (r % 2, (r // 2) % 2, r // 4)


def test_aliases() -> None:
    assert placement_order("cluster") == "DPT"
    assert placement_order("spread") == "TPD"
    assert Topology(4, 4, 2, placement="spread").order == "TPD"


# --- invariants over every placement and several shapes --------------------------------------


def _expected_size(topo: Topology, kind: GroupKind) -> int:
    return {
        "pp": topo.pipeline_degree,
        "tp": topo.tensor_degree,
        "rdp": topo.rdp_degree,
        "dp": topo.dp_degree,
        "mp": topo.mp_degree,
        "host": topo.processes_per_host,
        "cross_host": topo.num_hosts,
    }[kind]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "w{}-ph{}-pp{}-tp{}".format(*s))
def test_groups_partition_the_world(shape: tuple[int, int, int, int], placement: str) -> None:
    world, per_host, pp, tp = shape
    topo = Topology(world, per_host, pp, tp, placement)
    for kind in GROUP_KINDS:
        groups = topo.all_groups(kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), kind
        assert all(len(g) == _expected_size(topo, kind) for g in groups), kind
        assert len(groups) == world // _expected_size(topo, kind), kind
        assert all(g == sorted(g) for g in groups), kind
        assert groups == sorted(groups), kind
        for g in groups:
            for r in g:
                assert topo.group(kind, r) == g, (kind, r)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "w{}-ph{}-pp{}-tp{}".format(*s))
def test_coords_are_consistent(shape: tuple[int, int, int, int], placement: str) -> None:
    world, per_host, pp, tp = shape
    topo = Topology(world, per_host, pp, tp, placement)
    seen = set()
    for r in range(world):
        c = topo.coords(r)
        assert c.rank == r
        assert topo.rank_of(c.pp_rank, c.tp_rank, c.rdp_rank) == r
        seen.add((c.pp_rank, c.tp_rank, c.rdp_rank))
        # *_rank is the index in the sorted group, as torch.distributed.new_group numbers it.
        assert topo.pp_group(r).index(r) == c.pp_rank
        assert topo.tp_group(r).index(r) == c.tp_rank
        assert topo.rdp_group(r).index(r) == c.rdp_rank
        assert topo.dp_group(r).index(r) == c.dp_rank
        assert topo.mp_group(r).index(r) == c.mp_rank
        assert topo.host_group(r).index(r) == c.local_rank
        assert topo.cross_host_group(r).index(r) == c.host
        assert (c.host, c.local_rank) == divmod(r, per_host)
        # SMP v1 definitions: which coordinates a group's members share.
        for other in topo.pp_group(r):
            o = topo.coords(other)
            assert (o.rdp_rank, o.tp_rank) == (c.rdp_rank, c.tp_rank)
        for other in topo.tp_group(r):
            o = topo.coords(other)
            assert (o.rdp_rank, o.pp_rank) == (c.rdp_rank, c.pp_rank)
        for other in topo.rdp_group(r):
            o = topo.coords(other)
            assert (o.pp_rank, o.tp_rank) == (c.pp_rank, c.tp_rank)
        assert {topo.coords(o).pp_rank for o in topo.dp_group(r)} == {c.pp_rank}
        assert {topo.coords(o).rdp_rank for o in topo.mp_group(r)} == {c.rdp_rank}
    assert len(seen) == world


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_rightmost_letter_varies_over_neighbours(placement: str) -> None:
    topo = Topology(24, 24, pipeline_degree=2, tensor_degree=3, placement=placement)
    letter = topo.order[-1]
    size = {"D": topo.rdp_degree, "P": topo.pipeline_degree, "T": topo.tensor_degree}[letter]
    attr = {"D": "rdp_rank", "P": "pp_rank", "T": "tp_rank"}[letter]
    for r in range(0, 24, size):
        block = [topo.coords(r + i) for i in range(size)]
        assert [getattr(c, attr) for c in block] == list(range(size))
        others = {
            tuple(getattr(c, a) for a in ("rdp_rank", "pp_rank", "tp_rank") if a != attr)
            for c in block
        }
        assert len(others) == 1


def test_mixed_radix_formula() -> None:
    topo = Topology(24, 8, pipeline_degree=2, tensor_degree=3, placement="PDT")
    # P (size 2) · D (size 4) · T (size 3): rank = p*12 + d*3 + t
    for p in range(2):
        for d in range(4):
            for t in range(3):
                assert topo.rank_of(p, t, d) == p * 12 + d * 3 + t


def test_degrees() -> None:
    topo = Topology(32, 8, pipeline_degree=2, tensor_degree=2)
    assert topo.world_size == 32
    assert (topo.rdp_degree, topo.dp_degree, topo.mp_degree, topo.num_hosts) == (8, 16, 4, 4)


def test_data_parallel_only() -> None:
    topo = Topology(8, 4)
    assert topo.all_groups("dp") == [list(range(8))]
    assert topo.all_groups("mp") == [[r] for r in range(8)]
    assert topo.coords(5).dp_rank == 5


# --- hosts -----------------------------------------------------------------------------------


def test_host_groups_two_by_two() -> None:
    topo = Topology(4, 2)
    assert topo.host_names == ["algo-1", "algo-2"]
    assert topo.all_groups("host") == [[0, 1], [2, 3]]
    assert topo.all_groups("cross_host") == [[0, 2], [1, 3]]
    assert [(topo.coords(r).host, topo.coords(r).local_rank) for r in range(4)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert topo.coords(3).host_name == "algo-2"


@pytest.mark.parametrize(("world", "per_host"), [(12, 4), (8, 2), (4, 4), (6, 1)])
def test_host_and_cross_host_groups_cover_the_world_once(world: int, per_host: int) -> None:
    """What the hierarchical reducer builds on: a reduce-scatter in each host group, then an
    all-reduce of shard i across hosts between local ranks i, reduces every rank's bucket once:
    each host group meets each cross-host group in exactly one rank, its i-th."""
    topo = Topology(world, per_host)
    hosts, columns = topo.all_groups("host"), topo.all_groups("cross_host")
    assert len(hosts) == topo.num_hosts and len(columns) == per_host
    for host in hosts:
        for i, column in enumerate(columns):
            assert set(host) & set(column) == {host[i]}


# --- table -----------------------------------------------------------------------------------


def test_table() -> None:
    text = Topology(8, 4, pipeline_degree=2, tensor_degree=2, placement="spread").table()
    lines = text.splitlines()
    assert "TPD" in lines[0]
    assert lines[1].split() == ["rank", "host", "local_rank", "pp", "tp", "rdp", "dp", "mp"]
    assert len(lines) == 2 + 8
    assert lines[-1].split()[:2] == ["7", "algo-2"]


# --- errors ----------------------------------------------------------------------------------


def test_bad_placement_lists_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        Topology(8, 8, pipeline_degree=2, placement="DTT")
    assert info.value.key == "placement_strategy"
    for allowed in ("cluster", "spread", *PLACEMENT_ORDERS):
        assert allowed in str(info.value)


def test_misspelled_placement_suggests() -> None:
    with pytest.raises(ConfigError) as info:
        Topology(8, 8, placement="clustr")
    assert info.value.suggestion == "cluster"
    assert "did you mean 'cluster'" in str(info.value)


def test_lowercase_letters_suggest_uppercase() -> None:
    with pytest.raises(ConfigError) as info:
        Topology(8, 8, placement="dpt")
    assert info.value.suggestion == "DPT"


def test_non_string_placement() -> None:
    with pytest.raises(ConfigError, match="placement_strategy"):
        Topology(8, 8, placement=3)  # type: ignore[arg-type]


def test_world_not_divisible_by_processes_per_host() -> None:
    with pytest.raises(ConfigError) as info:
        Topology(10, 4)
    assert info.value.key == "processes_per_host"


def test_world_not_divisible_by_model_degree() -> None:
    with pytest.raises(ConfigError) as info:
        Topology(8, 8, pipeline_degree=3)
    assert info.value.key == "pipeline_parallel_degree"
    with pytest.raises(ConfigError, match="divide the world size 8"):
        Topology(8, 8, pipeline_degree=2, tensor_degree=3)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"world_size": 0}, "world_size"),
        ({"processes_per_host": -1}, "processes_per_host"),
        ({"pipeline_degree": 0}, "pipeline_parallel_degree"),
        ({"tensor_degree": True}, "tensor_parallel_degree"),
    ],
)
def test_non_positive_degrees(kwargs: dict[str, int], key: str) -> None:
    args = {"world_size": 8, "processes_per_host": 8, **kwargs}
    with pytest.raises(ConfigError) as info:
        Topology(**args)
    assert info.value.key == key


def test_out_of_range_lookups() -> None:
    topo = Topology(8, 8, pipeline_degree=2)
    with pytest.raises(ValueError):
        topo.coords(8)
    with pytest.raises(ValueError):
        topo.rank_of(2)
    with pytest.raises(ValueError):
        topo.group("zz", 0)  # type: ignore[arg-type]

"""What the script's FSDP1 runs with under SMP v2's degrees, as a table: the strategy, the mesh
dimensions and the warning, for every strategy a script may name; and where torch's FSDP1 would
leave one-rank shard groups training apart, an error."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import ShardingStrategy as S

from dtrain.smpv2.sharding import check_hybrid_groups, smp_sharding

BOTH = ("replicate", "hybrid_shard")
ZERO2 = S._HYBRID_SHARD_ZERO2

# (asked, shard ranks, replicas) -> (runs as, over, warned)
TABLE = {
    (None, 2, 1): (S.HYBRID_SHARD, BOTH, False),  # torch's default, FULL_SHARD
    (S.FULL_SHARD, 4, 1): (S.HYBRID_SHARD, BOTH, False),  # one shard group: the same thing
    (S.FULL_SHARD, 2, 2): (S.HYBRID_SHARD, BOTH, True),
    (S.SHARD_GRAD_OP, 2, 1): (ZERO2, BOTH, False),
    (S.SHARD_GRAD_OP, 2, 2): (ZERO2, BOTH, True),
    (S.HYBRID_SHARD, 2, 2): (S.HYBRID_SHARD, BOTH, False),
    (ZERO2, 2, 4): (ZERO2, BOTH, False),
    (S.NO_SHARD, 2, 1): (S.HYBRID_SHARD, BOTH, True),  # SMP overrides it too
    (S.HYBRID_SHARD, 1, 4): (S.NO_SHARD, ("replicate",), True),
    (S.NO_SHARD, 1, 4): (S.NO_SHARD, ("replicate",), False),
    (S.FULL_SHARD, 1, 1): (S.NO_SHARD, ("replicate",), False),  # a world of one: torch's clamp
}


@pytest.mark.parametrize(("asked", "shard_ranks", "replicas"), list(TABLE))
def test_the_strategy_and_mesh_smps_layout_gives(
    asked: S | None, shard_ranks: int, replicas: int
) -> None:
    run, mesh, warned = TABLE[asked, shard_ranks, replicas]
    got = smp_sharding(asked, shard_ranks, replicas)
    assert (got.strategy, got.mesh, got.changed is not None) == (run, mesh, warned)
    if warned:
        assert got.changed is not None
        assert got.changed.startswith(f"sharding_strategy {(asked or S.FULL_SHARD).name} runs as")
        assert f"hybrid_shard_degree {shard_ranks}" in got.changed


def test_hybrid_over_one_rank_groups_fails_where_replicas_would_train_apart() -> None:
    for strategy in (S.HYBRID_SHARD, ZERO2):
        with pytest.raises(ValueError, match=r"over shard groups of 1 rank \(2 of them\)"):
            check_hybrid_groups(strategy, 1, 2)
    check_hybrid_groups(S.HYBRID_SHARD, 1, 1)  # a world of one: nothing to average
    check_hybrid_groups(S.HYBRID_SHARD, 8, 2)  # torch's node-local groups on 8-GPU nodes
    check_hybrid_groups(S.FULL_SHARD, 1, 2)  # not hybrid: torch shards over the world

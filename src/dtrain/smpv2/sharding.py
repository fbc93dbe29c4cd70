"""Which strategy and groups the script's FSDP1 gets under SMP v2's degrees: decisions on sizes
alone, no processes (:mod:`dtrain.smpv2.fsdp` applies them).

SMP v2 shards over its own groups whatever strategy the script names: "if hybrid_shard_degree is
2 or more, SMP overrides the strategy in the script and sets it to HYBRID_SHARD" (AWS's hybrid
sharded data parallelism page). Here each parameter is sharded over the ``hybrid_shard_degree``
ranks of its shard group and replicated over the shard groups, on ``tsm.state.mesh("replicate",
"hybrid_shard")``. A strategy that keeps parameters gathered between forward and backward
(``SHARD_GRAD_OP``) keeps doing so (``_HYBRID_SHARD_ZERO2``).

torch's FSDP1 runs a hybrid strategy whose shard group is one rank as ``NO_SHARD`` over that one
rank (it clamps the strategy of any one-rank group), so its replicas never average their
gradients; that is why stock ``HYBRID_SHARD`` on CPU ranks, whose node-local groups are one rank
each, does not train like one process. A hybrid shard degree of 1 therefore runs as ``NO_SHARD``
over the replication group (every rank holds every parameter, as SMP's "1: no sharding" says),
and any other hybrid strategy over one-rank shard groups fails naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.fsdp import ShardingStrategy

HYBRID = frozenset({ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2})
"""The strategies that shard within a group and replicate across groups."""

_AS_HYBRID = {
    ShardingStrategy.FULL_SHARD: ShardingStrategy.HYBRID_SHARD,
    ShardingStrategy.SHARD_GRAD_OP: ShardingStrategy._HYBRID_SHARD_ZERO2,
    ShardingStrategy.NO_SHARD: ShardingStrategy.HYBRID_SHARD,
    ShardingStrategy.HYBRID_SHARD: ShardingStrategy.HYBRID_SHARD,
    ShardingStrategy._HYBRID_SHARD_ZERO2: ShardingStrategy._HYBRID_SHARD_ZERO2,
}
"""The hybrid strategy each strategy runs as over SMP's shard groups."""

_SAME_OVER_ONE_GROUP = {
    (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
    (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2),
}
"""(asked, run) pairs that differ in name only when there is a single shard group."""


@dataclass(frozen=True)
class Sharding:
    """What the script's FSDP1 runs with: a strategy, the dimensions of ``tsm.state.mesh`` it
    shards over, and why it differs from what the script asked (a warning), if it does."""

    strategy: ShardingStrategy
    mesh: tuple[str, ...]
    changed: str | None = None


def smp_sharding(asked: ShardingStrategy | None, shard_ranks: int, replicas: int) -> Sharding:
    """The sharding of SMP's layout: ``shard_ranks`` ranks per shard group (the resolved hybrid
    shard degree), ``replicas`` shard groups; ``asked`` is the script's strategy (``None``:
    torch's default, ``FULL_SHARD``)."""
    wanted = asked or ShardingStrategy.FULL_SHARD
    mesh: tuple[str, ...]
    if shard_ranks == 1:
        run, mesh = ShardingStrategy.NO_SHARD, ("replicate",)
        visible = wanted is not run and replicas > 1
        why = "hybrid_shard_degree 1 shards nothing: every rank holds every parameter"
    else:
        run, mesh = _AS_HYBRID[wanted], ("replicate", "hybrid_shard")
        visible = wanted is not run and not (
            replicas == 1 and (wanted, run) in _SAME_OVER_ONE_GROUP
        )
        why = (
            f"hybrid_shard_degree {shard_ranks} shards each parameter over {shard_ranks} ranks, "
            f"replicated over {replicas} shard groups, as SMP v2 does"
        )
    changed = f"sharding_strategy {wanted.name} runs as {run.name}: {why}" if visible else None
    return Sharding(run, mesh, changed)


def check_hybrid_groups(strategy: ShardingStrategy | None, shard_ranks: int, replicas: int) -> None:
    """Fail where torch's FSDP1 would run ``strategy`` over one-rank shard groups as ``NO_SHARD``
    and leave ``replicas`` > 1 replicas training apart (see the module's docstring)."""
    if strategy in HYBRID and shard_ranks == 1 and replicas > 1:
        raise ValueError(
            f"FullyShardedDataParallel: {strategy.name} over shard groups of 1 rank "
            f"({replicas} of them): torch's FSDP runs it as NO_SHARD within each group and its "
            "replicas never average their gradients; set hybrid_shard_degree to the ranks each "
            "parameter is sharded over (SMP v2's parameter), or give FSDP a device_mesh whose "
            "shard dimension has 2 ranks or more"
        )

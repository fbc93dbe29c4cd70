"""Two-level all-reduce for jobs spanning hosts: reduce inside each host first, then across hosts.

Stages, for a bucket of B bytes, L processes per host and H hosts:

1. reduce-scatter inside the host: local rank i ends with the host's sum of shard i (B/L bytes);
   each rank sends and receives (L-1)/L * B over the fast intra-host link.
2. all-reduce of shard i across hosts, between the ranks with local rank i: only B/L bytes per
   rank cross the network (2 (H-1)/H * B/L with a ring), L times less than a flat ring.
3. all-gather inside the host: every rank gets all L summed shards back, (L-1)/L * B again.

torch 2.13's gloo implements reduce-scatter (``reduce_scatter_single``, formerly
``reduce_scatter_tensor``), so stage 1 is a real reduce-scatter on CPU as well as on NCCL.
Its gloo work never reports ``is_completed()``, though, so the reducer only moves a chunk past
it by waiting (at the end of backward), not by polling during backward.
The reduce-scatter and the all-gather use two different groups over the same host ranks: the
reducer issues each stage in bucket order, and with one shared group the gather of bucket b
and the scatter of bucket b+1 could be issued in different orders on different ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from dtrain.dataparallel.single import all_gather_single, reduce_scatter_single, started
from dtrain.dataparallel.strategies import Transfer, own_group, private_buffers
from dtrain.environment import switch
from dtrain.topology import Topology

HIERARCHICAL_ENV = "DTRAIN_HIERARCHICAL_ALLREDUCE"
"""A switch (:mod:`dtrain.environment`) that forces hierarchical reduction on or off when the
constructor leaves it None."""


def wants_hierarchical(
    requested: bool | None, world_size: int, local_size: int, spans_world: bool
) -> bool:
    """Resolve ``hierarchical=None|True|False``: None reads the env var, else auto.

    Auto means more than one host and more than one process per host. Only a group spanning
    the whole world in rank order can be split by host here (every rank has to create the
    host groups, which it can only do for a layout it knows).
    """
    if requested is None:
        requested = switch(HIERARCHICAL_ENV, None)
    if requested is None:
        return spans_world and local_size > 1 and world_size > local_size
    if requested and not spans_world:
        raise ValueError(
            "hierarchical reduction needs a process group spanning all ranks in order; "
            "pass hierarchical=False for a sub-group"
        )
    return requested


@dataclass(frozen=True)
class HierarchicalAllReduce:
    """Reduce-scatter in the host, all-reduce across hosts, all-gather in the host."""

    scatter_group: dist.ProcessGroup
    cross_host_group: dist.ProcessGroup
    gather_group: dist.ProcessGroup
    pad_multiple: int
    num_stages: int = 3
    buffers = staticmethod(private_buffers)

    @classmethod
    def create(cls, rank: int, world_size: int, local_size: int) -> HierarchicalAllReduce:
        """Create the groups; every rank must call this at the same point (a collective)."""
        topology = Topology(world_size, local_size)
        hosts, columns = topology.all_groups("host"), topology.all_groups("cross_host")
        scatter = own_group(rank, hosts)
        cross_host = own_group(rank, columns)
        gather = own_group(rank, hosts)
        return cls(scatter, cross_host, gather, pad_multiple=local_size)

    def launch(self, stage: int, transfer: Transfer) -> dist.Work:
        if stage == 0:
            transfer.scratch = transfer.wire.new_empty(transfer.wire.numel() // self.pad_multiple)
            return started(
                reduce_scatter_single(
                    transfer.scratch, transfer.wire, group=self.scatter_group, async_op=True
                )
            )
        shard = transfer.scratch
        assert shard is not None, "stage 0 allocates the shard"
        if stage == 1:
            return dist.all_reduce(shard, group=self.cross_host_group, async_op=True)
        return started(
            all_gather_single(transfer.wire, shard, group=self.gather_group, async_op=True)
        )

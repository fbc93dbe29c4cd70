"""Object messaging between ranks (smp.broadcast/send/recv_from/allgather/gather/barrier)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import CommunicationTimeoutError, NotInitializedError
from tests.modelparallel.harness import run_ranks

CONFIG = {"pipeline_parallel_degree": 2, "ddp": True}  # cluster: pp [0,1] [2,3], dp [0,2] [1,3]


def _messaging() -> dict[str, Any]:
    dist.init_process_group("gloo")  # kept across the two smp.init calls below
    smp.init(CONFIG)
    me = smp.rank()
    out: dict[str, Any] = {
        "allgather": {g.name: smp.allgather(me, g) for g in smp.CommGroup},
        "gather": smp.gather(me * 10, smp.DP_GROUP, rank=1),
    }
    # pipeline leaders broadcast to their pipeline (SMP: a send to every other member)
    if smp.pp_rank() == 0:
        smp.broadcast({"from": me, "tensor": torch.arange(3) + me}, smp.PP_GROUP)
    else:
        out["from_leader"] = smp.recv_from(0, smp.RankType.PP_RANK)
    # rank 3 sends rank 0 two messages, a large one first; they arrive in order
    big = bytes(range(256)) * 4096  # 1 MiB
    if me == 3:
        smp.send(big, 0, smp.RankType.WORLD_RANK)
        smp.send("second", 0, smp.RankType.WORLD_RANK)
    elif me == 0:
        out["ordered"] = [smp.recv_from(3, smp.RankType.WORLD_RANK) == big,
                          smp.recv_from(3, smp.RankType.WORLD_RANK)]  # fmt: skip
    # dp rank 1 broadcasts to its dp group (one other member)
    if smp.dp_rank() == 1:
        smp.broadcast(f"dp from {me}", smp.DP_GROUP)
    else:
        out["dp_message"] = smp.recv_from(1, smp.RankType.DP_RANK)
    for barrier in (smp.barrier, smp.mp_barrier, smp.pp_barrier, smp.dp_barrier,
                    smp.tp_barrier, smp.rdp_barrier):  # fmt: skip
        barrier()
    for bad in (lambda: smp.send(1, smp.pp_rank(), smp.RankType.PP_RANK),
                lambda: smp.recv_from(2, smp.RankType.PP_RANK)):  # fmt: skip
        try:
            bad()
        except ValueError as exc:
            out.setdefault("misuse", []).append(str(exc))
    smp.shutdown()
    os.environ["DTRAIN_MP_TIMEOUT"] = "3"
    smp.init(CONFIG)
    if me == 1:  # rank 0 never sends: the wait must end and name rank 0
        try:
            smp.recv_from(0, smp.RankType.WORLD_RANK)
        except CommunicationTimeoutError as exc:
            out["timeout"] = str(exc)
    dist.barrier()  # the script's world, untouched by the failed object group
    return out


def test_objects_travel_within_each_group_and_waits_time_out() -> None:
    results = run_ranks(4, _messaging)
    pp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    dp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank, out in enumerate(results):
        assert out["allgather"] == {
            "WORLD": [0, 1, 2, 3],
            "PP_GROUP": pp[rank],
            "TP_GROUP": [rank],
            "RDP_GROUP": dp[rank],
            "DP_GROUP": dp[rank],
            "MP_GROUP": pp[rank],
        }
        assert out["gather"] == ([r * 10 for r in dp[rank]] if rank in (2, 3) else None)
        if rank % 2:  # pp rank 1
            leader = pp[rank][0]
            assert out["from_leader"]["from"] == leader
            assert torch.equal(out["from_leader"]["tensor"], torch.arange(3) + leader)
        else:
            assert "from_leader" not in out
        if rank < 2:  # dp rank 0
            assert out["dp_message"] == f"dp from {dp[rank][1]}"
        else:
            assert "dp_message" not in out
        assert out["misuse"] == [
            f"smp.send: rank {rank} cannot send to itself",
            "PP_RANK 2 does not exist: allowed 0 to 1",
        ]
    assert results[0]["ordered"] == [True, "second"]
    assert results[1]["timeout"].startswith("rank 1: recv_from rank 0 (WORLD_RANK 0): no answer")
    assert "within 3 s" in results[1]["timeout"]


def test_messaging_needs_init() -> None:
    with pytest.raises(NotInitializedError, match=r"smp\.broadcast needs"):
        smp.broadcast(1, smp.WORLD)
    with pytest.raises(NotInitializedError, match=r"smp\.barrier needs"):
        smp.barrier()


def test_enums_have_smp_values() -> None:
    assert [g.value for g in smp.CommGroup] == list(range(6))
    assert [smp.WORLD, smp.PP_GROUP, smp.TP_GROUP, smp.RDP_GROUP, smp.DP_GROUP, smp.MP_GROUP] == [
        0, 1, 2, 3, 4, 5
    ]  # fmt: skip
    assert [t.name for t in smp.RankType] == [
        "WORLD_RANK", "PP_RANK", "TP_RANK", "RDP_RANK", "DP_RANK", "MP_RANK"
    ]  # fmt: skip

"""pp × tp × rdp rank placement for every placement string (tables, no processes), and the
tensor-parallel groups smp.init makes (one 4-rank run)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import dtrain.modelparallel as smp
from dtrain.modelparallel import state
from dtrain.topology import Topology
from tests.modelparallel.harness import run_ranks

# World 8, pp = tp = rdp = 2: each rank's "pp tp rdp" digits, rank 0 to 7. The right-most
# letter of a placement varies over neighbouring ranks (SMP: cluster = DPT, spread = TPD).
PLACEMENT_TABLE = {
    "DPT": "000 010 100 110 001 011 101 111",
    "DTP": "000 100 010 110 001 101 011 111",
    "PDT": "000 010 001 011 100 110 101 111",
    "PTD": "000 001 010 011 100 101 110 111",
    "TDP": "000 100 001 101 010 110 011 111",
    "TPD": "000 001 100 101 010 011 110 111",
    "cluster": "000 010 100 110 001 011 101 111",
    "spread": "000 001 100 101 010 011 110 111",
}


@pytest.mark.parametrize("placement", sorted(PLACEMENT_TABLE))
def test_rank_to_pp_tp_rdp(placement: str) -> None:
    topo = Topology(8, 8, pipeline_degree=2, tensor_degree=2, placement=placement)
    got = []
    for rank in range(8):
        c = topo.coords(rank)
        got.append(f"{c.pp_rank}{c.tp_rank}{c.rdp_rank}")
    assert " ".join(got) == PLACEMENT_TABLE[placement]


@pytest.mark.parametrize("placement", sorted(PLACEMENT_TABLE))
def test_groups_follow_the_table(placement: str) -> None:
    """tp groups share pp and rdp; rdp groups share pp and tp; dp groups share pp."""
    topo = Topology(8, 8, pipeline_degree=2, tensor_degree=2, placement=placement)
    digits = dict(enumerate(PLACEMENT_TABLE[placement].split()))
    for rank in range(8):
        pp, tp, rdp = digits[rank]
        same = {
            "tp": [r for r in range(8) if (digits[r][0], digits[r][2]) == (pp, rdp)],
            "rdp": [r for r in range(8) if digits[r][:2] == pp + tp],
            "dp": [r for r in range(8) if digits[r][0] == pp],
            "pp": [r for r in range(8) if digits[r][1:] == tp + rdp],
            "mp": [r for r in range(8) if digits[r][2] == rdp],
        }
        for kind, members in same.items():
            assert topo.group(kind, rank) == members, (kind, rank)


def _tensor_groups(placement: str) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "placement_strategy": placement})
    st = state.current()
    total = torch.tensor([float(st.rank)])
    dist.all_reduce(total, group=smp.get_tp_process_group())
    rdp_total = torch.tensor([float(st.rank)])
    dist.all_reduce(rdp_total, group=smp.get_rdp_process_group())
    smp.tp_barrier()
    smp.rdp_barrier()
    assert st.tensor_mesh is not None
    return {
        "tp": (smp.tp_rank(), smp.tp_size(), smp.get_tp_group(), total.item()),
        "rdp": (smp.rdp_rank(), smp.rdp_size(), smp.get_rdp_group(), rdp_total.item()),
        "dp": (smp.dp_rank(), smp.dp_size(), smp.get_dp_group()),
        "pp": (smp.pp_rank(), smp.pp_size()),
        "mesh": st.tensor_mesh.mesh.tolist(),
        "tp_ranks": dist.get_process_group_ranks(smp.get_tp_process_group()),
    }


def test_init_makes_working_tensor_parallel_groups() -> None:
    results = run_ranks(4, _tensor_groups, "cluster")
    for rank, got in enumerate(results):
        tp_group = [rank - rank % 2, rank - rank % 2 + 1]
        rdp_group = [rank % 2, rank % 2 + 2]
        assert got["tp"] == (rank % 2, 2, tp_group, float(sum(tp_group)))
        assert got["rdp"] == (rank // 2, 2, rdp_group, float(sum(rdp_group)))
        assert got["dp"] == (rank, 4, [0, 1, 2, 3])
        assert got["pp"] == (0, 1)
        assert got["mesh"] == got["tp_ranks"] == tp_group

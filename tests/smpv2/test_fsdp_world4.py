"""The script's own FSDP under ``tsm.init()`` on 4 ranks trains like one process on the same
global batch (:mod:`tests.smpv2.fsdp_cases`): hybrid shard degree 2 over 2 replicas, with FSDP1
as AWS's scripts build it (the script's HYBRID_SHARD, or FULL_SHARD, which SMP runs as
HYBRID_SHARD) and with FSDP2's ``fully_shard``; hybrid shard degree 1 (4 replicas, no sharding);
tensor parallel degree 2 x hybrid shard degree 2, the model split over the tp mesh by
``tsm.transform`` (DTensors) under FSDP1 and FSDP2, and with activation offloading as AWS's
script applies it (``sm_activation_offloading``).

3 SGD steps of tiny Llama and GPT-NeoX models; every case in one world of 4 gloo ranks.
"""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import ShardingStrategy

from tests.modelparallel.harness import run_ranks
from tests.smpv2.fsdp_cases import HF_ENV, Case, Trained, reference, train_cases
from tests.smpv2.test_fsdp import assert_trains_like, smp_warnings

pytest.importorskip("transformers")

HSD2 = {"hybrid_shard_degree": 2}
TP2_HSD2 = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
CASES = {
    "llama_hybrid": Case("llama", HSD2),
    "neox_full_shard": Case("neox", HSD2, strategy=ShardingStrategy.FULL_SHARD),
    "llama_fully_shard": Case("llama", HSD2, fsdp="fsdp2"),
    "llama_hsd1": Case("llama", {"hybrid_shard_degree": 1}),
    "tp_hybrid": Case("llama", TP2_HSD2, tensor_parallel=True),
    "tp_fully_shard": Case("llama", TP2_HSD2, fsdp="fsdp2", tensor_parallel=True),
    "tp_offloading": Case("llama", TP2_HSD2, tensor_parallel=True, offloading=True),
    "tp_hsd1": Case(
        "llama", {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}, tensor_parallel=True
    ),
}


@pytest.fixture(scope="module")
def world() -> dict[str, Trained | str]:
    rank0, *_ = run_ranks(4, train_cases, list(CASES.values()), timeout=300, env=HF_ENV)
    return dict(zip(CASES, rank0, strict=True))


@pytest.mark.parametrize("name", ["llama_hybrid", "neox_full_shard", "llama_fully_shard"])
def test_hybrid_shard_2_over_2_replicas_trains_like_one_process(
    world: dict[str, Trained | str], name: str
) -> None:
    got = world[name]
    assert_trains_like(got, reference(CASES[name].family))
    assert isinstance(got, Trained)
    if CASES[name].fsdp == "fsdp1":
        assert got.extra["process_group"] == [0, 1]  # rank 0's shard group
    else:  # sharded over (replicate, hybrid_shard), not over the world
        assert got.extra["meshes"] == {"[[0, 1], [2, 3]]"}


def test_the_scripts_full_shard_runs_as_hybrid_shard_saying_so(
    world: dict[str, Trained | str],
) -> None:
    got = world["neox_full_shard"]
    assert isinstance(got, Trained)
    assert smp_warnings(got) == [
        "FullyShardedDataParallel: sharding_strategy FULL_SHARD runs as HYBRID_SHARD: "
        "hybrid_shard_degree 2 shards each parameter over 2 ranks, replicated over 2 shard "
        "groups, as SMP v2 does"
    ]
    assert smp_warnings(world["llama_hybrid"]) == []  # type: ignore[arg-type]


def test_hybrid_shard_degree_1_replicates_every_parameter(world: dict[str, Trained | str]) -> None:
    """One-rank shard groups: NO_SHARD over the 4 replicas (torch's HYBRID_SHARD over them
    would train each replica alone)."""
    got = world["llama_hsd1"]
    assert_trains_like(got, reference("llama"))
    assert isinstance(got, Trained)
    assert got.extra["process_group"] == [0, 1, 2, 3]
    assert smp_warnings(got) == [
        "FullyShardedDataParallel: sharding_strategy HYBRID_SHARD runs as NO_SHARD: "
        "hybrid_shard_degree 1 shards nothing: every rank holds every parameter"
    ]


@pytest.mark.parametrize("name", ["tp_hybrid", "tp_fully_shard"])
def test_tp_2_x_hybrid_shard_2_trains_like_one_process(
    world: dict[str, Trained | str], name: str
) -> None:
    """FSDP over ``tsm.state.mesh("replicate", "hybrid_shard")`` of parameters that are
    DTensors on ``tsm.state.mesh("tp")``: both meshes are slices of one root."""
    got = world[name]
    assert_trains_like(got, reference("llama"))
    assert isinstance(got, Trained)
    if CASES[name].fsdp == "fsdp1":
        assert got.extra["process_group"] == [0, 2]  # rank 0's shard group: same tp rank
    else:  # the embeddings over (replicate, hybrid_shard), the split layers with tp too
        assert got.extra["meshes"] == {"[[0, 2]]", "[[[0, 1], [2, 3]]]"}


def test_activation_offloading_over_tensor_parallel_parameters(
    world: dict[str, Trained | str],
) -> None:
    """torch's ``offload_wrapper`` fails on DTensor weights; the one ``torch.sagemaker`` serves
    under its name offloads them (:mod:`dtrain.smpv2.offload`)."""
    assert_trains_like(world["tp_offloading"], reference("llama"))


def test_fsdp1_refuses_no_shard_over_tensor_parallel_parameters(
    world: dict[str, Trained | str],
) -> None:
    refused = world["tp_hsd1"]
    assert isinstance(refused, str)
    assert "hybrid_shard_degree 1 runs as NO_SHARD, which torch's FSDP cannot run" in refused

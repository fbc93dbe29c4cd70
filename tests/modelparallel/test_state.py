"""smp.init: configuration, rank layout and process groups (multi-process: 4 gloo ranks)."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dtrain.modelparallel as smp
from dtrain.errors import ConfigError, UnknownKeyError
from dtrain.modelparallel import state
from dtrain.modelparallel.errors import (
    ModelParallelError,
    MultipleDistributedModelError,
    NotInitializedError,
)
from dtrain.modelparallel.options import RuntimeOptions
from tests.modelparallel.harness import run_ranks, single_process

PIPELINE_OF_TWO = {"pipeline_parallel_degree": 2, "ddp": True, "microbatches": 8}
RANK_FUNCTIONS = ["rank", "size", "local_rank", "local_size"]
RANK_FUNCTIONS += [f"{kind}_{what}" for kind in state.GROUP_KINDS for what in ("rank", "size")]
RANK_FUNCTIONS += [f"get_{kind}_group" for kind in state.GROUP_KINDS]


@pytest.fixture(autouse=True)
def _no_job_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SM_HP_MP_PARAMETERS", "DTRAIN_MP_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def _layout() -> dict[str, Any]:
    """This rank's view of the layout, and proof that each of its groups really works."""
    st = state.current()
    ranks = {
        kind: dist.get_process_group_ranks(getattr(st, f"{kind}_process_group"))
        for kind in state.GROUP_KINDS
    }
    messaging = st.pp_message_group
    total = torch.tensor([float(st.rank)])
    dist.all_reduce(total, group=st.pp_process_group)
    return {
        "names": {name: getattr(smp, name)() for name in RANK_FUNCTIONS},
        "process_group_ranks": ranks,
        "messaging": (dist.get_process_group_ranks(messaging), dist.get_backend(messaging)),
        "objects": {k: dist.get_process_group_ranks(g) for k, g in st.object_groups.items()},
        "pp_sum": total.item(),
        "config": dict(st.config),
        "timeout": st.options.timeout,
        "device": str(st.device),
        "owns_world": st.owns_world,
    }


def _init_from_mpi_environment() -> dict[str, Any]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        del os.environ[name]  # as under mpirun: only OMPI_COMM_WORLD_* and MASTER_ADDR/PORT
    smp.init({"partitions": 2, "memory_weight": 0.5})  # adds to the job's, agrees with them
    return _layout()


def test_init_from_job_parameters_with_cluster_placement() -> None:
    params = json.dumps({**PIPELINE_OF_TWO, "placement_strategy": "cluster"})
    env = {"SM_HP_MP_PARAMETERS": params, "DTRAIN_MP_TIMEOUT": "60"}
    results = run_ranks(4, _init_from_mpi_environment, env=env, local_size=2)
    pp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    dp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank, result in enumerate(results):
        names = result["names"]
        assert names["rank"] == rank and names["size"] == 4
        assert (names["local_rank"], names["local_size"]) == (rank % 2, 2)
        assert (names["pp_rank"], names["pp_size"]) == (rank % 2, 2)
        assert (names["dp_rank"], names["dp_size"]) == (rank // 2, 2)
        assert (names["mp_rank"], names["mp_size"]) == (rank % 2, 2)
        assert (names["rdp_rank"], names["rdp_size"]) == (rank // 2, 2)
        assert (names["tp_rank"], names["tp_size"]) == (0, 1)
        assert names["get_pp_group"] == names["get_mp_group"] == pp[rank]
        assert names["get_dp_group"] == names["get_rdp_group"] == dp[rank]
        assert names["get_tp_group"] == [rank]
        groups = {"pp": pp[rank], "mp": pp[rank], "dp": dp[rank], "rdp": dp[rank], "tp": [rank]}
        assert result["process_group_ranks"] == groups
        assert result["objects"] == {**groups, "world": [0, 1, 2, 3]}
        assert result["messaging"] == (pp[rank], "gloo")
        assert result["pp_sum"] == sum(pp[rank])
        config = result["config"]
        assert config["microbatches"] == 8 and config["pipeline_parallel_degree"] == 2
        assert config["active_microbatches"] == 4  # pp + 2, at most microbatches
        assert config["pipeline"] == "interleaved" and config["memory_weight"] == 0.5
        assert result["timeout"] == 60.0 and result["device"] == "cpu" and result["owns_world"]


def _layouts_and_config_errors() -> dict[str, Any]:
    dist.init_process_group("gloo")  # the script's own world: smp.init must reuse it
    out: dict[str, Any] = {}
    smp.init({**PIPELINE_OF_TWO, "placement_strategy": "spread"})
    out["spread"] = _layout()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smp.init({"pipeline_parallel_degree": 2})  # agrees with what runs: a warning only
    out["second_init"] = [str(w.message) for w in caught]
    try:
        smp.init({"pipeline_parallel_degree": 4})
    except ConfigError as error:
        out["conflicting_init"] = str(error)
    out["pp_after_second_init"] = smp.pp_size()
    smp.shutdown()
    out["world_kept"] = dist.is_initialized() and not smp.is_initialized()
    for name, config in {
        "pp3": {"pipeline_parallel_degree": 3, "ddp": True},
        "no_ddp": {"pipeline_parallel_degree": 2},
    }.items():
        try:
            smp.init(config)
            out[name] = "no error"
        except ConfigError as exc:
            out[name] = str(exc)
        out[f"{name}_initialized"] = smp.is_initialized()
    return out


def test_spread_placement_reuses_the_scripts_world_and_checks_world_size() -> None:
    results = run_ranks(4, _layouts_and_config_errors)
    pp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    dp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for rank, result in enumerate(results):
        names = result["spread"]["names"]
        assert (names["pp_rank"], names["dp_rank"]) == (rank // 2, rank % 2)
        assert names["get_pp_group"] == pp[rank] and names["get_dp_group"] == dp[rank]
        assert result["spread"]["process_group_ranks"]["dp"] == dp[rank]
        assert result["spread"]["pp_sum"] == sum(pp[rank])
        assert not result["spread"]["owns_world"] and result["world_kept"]
        assert result["second_init"] == [
            "smp.init: the model-parallel runtime is already initialized, ignoring this call"
        ]
        assert result["conflicting_init"].startswith(
            "mp_parameters.pipeline_parallel_degree: got 4; allowed: 2, the value the runtime"
        )
        assert result["pp_after_second_init"] == 2
        assert "must divide the world size 4" in result["pp3"]
        assert "ddp" in result["no_ddp"] and "set ddp: true" in result["no_ddp"]
        assert not result["pp3_initialized"] and not result["no_ddp_initialized"]


@pytest.mark.parametrize(
    "call",
    [smp.rank, smp.pp_size, smp.get_dp_group, smp.get_pp_process_group, smp.num_microbatches],
)
def test_api_needs_init(call: Any) -> None:
    with pytest.raises(NotInitializedError, match=r"smp\.init\(\) first") as info:
        call()
    assert call.__name__ in str(info.value)


def test_bad_config_fails_before_joining_a_world() -> None:
    with pytest.raises(UnknownKeyError, match="did you mean 'microbatches'"):
        smp.init({"microbatch": 2})
    with pytest.raises(ConfigError, match=r"mp_parameters\.placement_strategy: got 'PTX'"):
        smp.init({"tensor_parallel_degree": 2, "partitions": 2, "placement_strategy": "PTX"})
    with pytest.raises(ConfigError, match=r"mp_parameters\.pipeline: got 'fast'"):
        smp.init({"pipeline": "fast"})
    assert not smp.is_initialized() and not dist.is_initialized()


def test_bad_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", "[1, 2]")
    with pytest.raises(ConfigError, match=r"SM_HP_MP_PARAMETERS.*a JSON object"):
        smp.init()
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", "{}")
    monkeypatch.setenv("DTRAIN_MP_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match=r"DTRAIN_MP_TIMEOUT.*positive number of seconds"):
        smp.init()
    monkeypatch.setenv("DTRAIN_MP_TIMEOUT", "60")
    monkeypatch.setenv("DTRAIN_MP_STALL_REPORT", "-1")
    with pytest.raises(ConfigError, match=r"DTRAIN_MP_STALL_REPORT: got '-1'; allowed: a posit"):
        smp.init()
    assert not dist.is_initialized()


def test_runtime_options_read_the_environment() -> None:
    assert RuntimeOptions.from_environment({}) == RuntimeOptions()
    environ = {"DTRAIN_MP_TIMEOUT": "2.5", "DTRAIN_MP_STALL_REPORT": "10"}
    assert RuntimeOptions.from_environment(environ) == RuntimeOptions(2.5, 10.0)
    with pytest.raises(ConfigError, match="DTRAIN_MP_TIMEOUT"):
        RuntimeOptions.from_environment({"DTRAIN_MP_TIMEOUT": "inf"})


def test_the_scripts_config_and_the_jobs_parameters_add_up_and_the_jobs_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"partitions": 1, "microbatches": 3}))
    config = {"pipeline_parallel_degree": 1, "microbatches": 8, "pipeline": "simple",
              "static_mode": True, "fast_mode": False}  # fmt: skip
    with pytest.warns(UserWarning) as caught, single_process(config):
        st = state.current()
        assert st.config["pipeline_parallel_degree"] == 1
        assert smp.num_microbatches() == 3 and st.config["pipeline"] == "simple"
        assert st.config["active_microbatches"] == 3
        assert (st.size, st.pp_size, st.dp_size, st.options.timeout) == (1, 1, 1, 300.0)
        assert st.owns_world
    said = sorted({str(warning.message) for warning in caught})
    assert said == [
        "mp_parameters.fast_mode is one of SMP's internal parameters: accepted and ignored",
        "mp_parameters.static_mode is one of SMP's internal parameters: accepted and ignored",
        "smp.init: mp_parameters.microbatches is 3, the job's value (SM_HP_MP_PARAMETERS), "
        "not the script's 8",
    ]
    assert not dist.is_initialized() and not smp.is_initialized()
    with pytest.raises(ConfigError, match="pipeline: got 'simpel'"):
        smp.init({"pipeline": "simpel"})
    with pytest.raises(ConfigError, match="did you mean 'microbatches'"):
        smp.init({"microbatchs": 3})
    assert not smp.is_initialized()


def test_importing_smp_in_a_job_starts_it_at_first_use_with_the_scripts_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"microbatches": 2}))
    names = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    state.request_auto_init()
    try:
        smp.init({"pipeline": "simple"})
        assert state.current().config["pipeline"] == "simple"
        assert smp.num_microbatches() == 2
    finally:
        smp.shutdown()
    state.request_auto_init()
    try:
        assert smp.rank() == 0  # the first use starts it, with the job's parameters alone
        assert state.current().config["pipeline"] == "interleaved"
    finally:
        smp.shutdown()


def test_one_distributed_model_per_process_until_reset() -> None:
    first, second = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    with pytest.raises(NotInitializedError):
        state.register_model(first)
    with single_process():
        state.register_model(first)
        state.register_model(first)  # the same model again is fine
        with pytest.raises(MultipleDistributedModelError, match=r"smp\.reset\(\)"):
            state.register_model(second)
        smp.reset()
        assert state.current_model() is None
        state.register_model(second)
        assert state.current_model() is second
    assert state.current_model() is None


@pytest.mark.parametrize(
    ("gpus", "local_rank", "local_size", "backend", "expected"),
    [
        (0, 1, 2, None, ("gloo", "cpu")),  # no GPU: smp.init makes a gloo world on the CPU
        (0, 0, 2, "gloo", ("gloo", "cpu")),
        (2, 1, 2, None, ("nccl", "cuda:1")),  # a GPU per process: NCCL, as SMP
        (8, 3, 4, "nccl", ("nccl", "cuda:3")),
        (1, 1, 2, None, ("gloo", "cuda:0")),  # pp=2 on one GPU: both ranks share it
        (2, 3, 4, None, ("gloo", "cuda:1")),
        (2, 1, 2, "gloo", ("gloo", "cuda:1")),  # the script's gloo world computes on the GPUs
        (1, 1, 2, "gloo", ("gloo", "cuda:0")),
    ],
)
def test_where_a_rank_computes_and_which_world_smp_init_makes(
    gpus: int, local_rank: int, local_size: int, backend: str | None, expected: tuple[str, str]
) -> None:
    chosen, device = state.rank_device(gpus, local_rank, local_size, backend)
    assert (chosen, str(device)) == expected


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_an_nccl_world_cannot_put_two_ranks_on_one_gpu(backend: str) -> None:
    with pytest.raises(ModelParallelError, match="runs 2 processes on 1 GPU") as info:
        state.rank_device(1, 0, 2, backend)
    assert repr(backend) in str(info.value) and "let smp.init create the world" in str(info.value)


def _init_with_one_gpu() -> dict[str, Any]:
    """smp.init on a host of two processes that sees one GPU (as far as it knows: this machine
    has none; ``torch.cuda.set_device`` records instead of selecting)."""
    selected: list[str] = []
    state.visible_gpus = lambda: 1
    torch.cuda.set_device = lambda device: selected.append(str(device))
    smp.init(PIPELINE_OF_TWO)
    st = state.current()
    return {"backend": dist.get_backend(), "device": str(st.device), "selected": selected}


def test_ranks_that_share_a_gpu_get_a_gloo_world_and_compute_on_it() -> None:
    results = run_ranks(2, _init_with_one_gpu)
    assert results == [{"backend": "gloo", "device": "cuda:0", "selected": ["cuda:0"]}] * 2

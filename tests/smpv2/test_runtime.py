"""``tsm.init()`` and ``tsm.state`` in a world of one process: what a script may set before
``init``, the job's parameters winning over the script's, and each misuse failing by name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from dtrain.errors import ConfigError
from dtrain.modelparallel import heap
from dtrain.smpv2 import init, is_initialized, shutdown, state
from dtrain.smpv2.runtime import NotInitializedError

LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SM_HP_MP_PARAMETERS")


@pytest.fixture(autouse=True)
def alone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as a world of its own, whatever launched the tests; shut down after."""
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    yield
    shutdown()
    assert not dist.is_initialized()


def test_before_init_the_script_may_set_parameters_only() -> None:
    with pytest.raises(NotInitializedError, match=r"tsm.state.tp_rank: call tsm.init\(\) first"):
        _ = state.tp_rank
    with pytest.raises(AttributeError, match="no attribute 'tp_rnak'"):
        _ = state.tp_rnak
    state.tensor_parallel_degree = 1  # AWS's scripts, without SMP's implementation
    assert state.tensor_parallel_degree == 1
    with pytest.raises(AttributeError, match=r"tsm.state.tp_rank cannot be set"):
        state.tp_rank = 0
    with pytest.raises(ConfigError, match=r"tsm.state.context_parallel_degree: got 0"):
        state.context_parallel_degree = 0


def test_a_world_of_one() -> None:
    init()
    assert is_initialized() and dist.get_world_size() == 1
    assert (state.rank, state.world_size, state.tp_rank, state.tp_size) == (0, 1, 0, 1)
    assert (state.cp_rank, state.cp_size, state.ep_rank, state.ep_size) == (0, 1, 0, 1)
    assert state.hybrid_shard_degree == 0  # the script's FSDP as torch has it
    assert state.sm_activation_offloading is True  # SMP's default
    assert state.ranker.get_rep_groups() == [[0]]
    assert state.mesh("replicate", "hybrid_shard").mesh.tolist() == [[0]]
    assert state.world_process_group is dist.group.WORLD
    with pytest.raises(ValueError, match="give some of"):
        state.mesh("shard")


def test_init_returns_the_large_blocks_fsdp_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The script's FSDP gathers and frees every unit at each use: glibc's heap must give those
    blocks back (``heap.prepare``'s own tests check that it does), as ``smp.init`` has it for
    sharded data parallelism."""
    asked: list[bool] = []
    monkeypatch.setattr(heap, "prepare", lambda keep_freed_blocks: asked.append(keep_freed_blocks))
    init()
    assert asked == [False]


def test_the_jobs_parameters_win_over_the_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"random_seed": 1}')
    state.sm_activation_offloading = False  # the script's, set before init: kept
    with pytest.warns(UserWarning, match=r"mp_parameters.random_seed is 1, the job's value"):
        init({"random_seed": 2})
    assert (state.random_seed, state.sm_activation_offloading) == (1, False)


def test_the_random_stream_of_tensor_parallel_code_is_seeded_with_random_seed() -> None:
    init({"random_seed": 9})
    with state.get_rng_state_tracker().fork():
        drawn = torch.rand(3)
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(9 + 0)))


def test_once_running_the_parameters_cannot_change() -> None:
    init({"random_seed": 3})
    state.random_seed = 3  # the same: nothing to change
    with pytest.raises(ConfigError, match=r"tsm.state.random_seed: got 4; allowed: 3, the value"):
        state.random_seed = 4
    with pytest.warns(UserWarning, match="already initialized"):
        init({"random_seed": 3})
    with pytest.raises(ConfigError, match=r"mp_parameters.random_seed: got 5; allowed: 3"):
        init({"random_seed": 5})


@pytest.mark.parametrize(
    ("assigned", "config", "expected"),
    [
        ({"random_seed": 5}, {"random_seed": 6}, "tsm.init.random_seed: got 6; allowed: 5"),
        ({}, {"partitions": 2}, "mp_parameters.partitions: got 2; allowed: an SMP v2 parameter"),
        ({}, {"expert_parallel_degree": 2}, "not available yet in dtrain"),
        ({}, {"tensor_parallel_degree": 2}, "tensor_parallel_degree: got 2; allowed: a divisor "
         "of the world size 1"),
    ],
)  # fmt: skip
def test_misconfigurations_fail_before_anything_runs(
    assigned: dict[str, int], config: dict[str, int], expected: str
) -> None:
    for name, value in assigned.items():
        setattr(state, name, value)
    with pytest.raises(ConfigError) as caught:
        init(config)
    assert expected in str(caught.value)
    assert not is_initialized() and not dist.is_initialized()  # a world it made is gone again


def test_the_jobs_parameters_must_be_a_json_object(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", "[1]")
    with pytest.raises(ConfigError, match="SM_HP_MP_PARAMETERS: got '\\[1\\]'"):
        init()

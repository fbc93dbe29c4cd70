"""SMP v2 parameters: defaults as AWS's reference gives them, AWS's rules for the degrees, and
errors that name the key, the value, what is allowed and the pairing a v1 parameter belongs to."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from dtrain.config.smpv2 import (
    SMP_V2_PARAMETER_NAMES,
    V1_ONLY_NAMES,
    V2_ONLY_NAMES,
    hybrid_shard_extent,
    runs_native_fsdp,
    schema_markdown,
    validate_smp_v2_parameters,
)
from dtrain.errors import ConfigError, UnknownKeyError

P = "parameters"


def test_defaults_filled_in_schema_order() -> None:
    values = validate_smp_v2_parameters({})
    assert tuple(values) == SMP_V2_PARAMETER_NAMES
    assert values == {
        "hybrid_shard_degree": 0,
        "sm_activation_offloading": True,
        "activation_loading_horizon": 2,
        "fsdp_cache_flush_warnings": True,
        "allow_empty_shards": False,
        "tensor_parallel_degree": 1,
        "context_parallel_degree": 1,
        "expert_parallel_degree": 1,
        "random_seed": 12345,
    }


def test_value_forms_normalized() -> None:
    values = validate_smp_v2_parameters({"sm_activation_offloading": "False", "random_seed": 7.0})
    assert values["sm_activation_offloading"] is False
    assert values["random_seed"] == 7 and isinstance(values["random_seed"], int)


def test_the_pairings_own_names() -> None:
    assert {"hybrid_shard_degree", "context_parallel_degree", "random_seed"} <= set(V2_ONLY_NAMES)
    assert {"partitions", "pipeline_parallel_degree", "microbatches", "ddp"} <= set(V1_ONLY_NAMES)
    shared = {"tensor_parallel_degree", "activation_loading_horizon"}
    assert not shared & set(V1_ONLY_NAMES) and not shared & set(V2_ONLY_NAMES)


# (world size, parameters): layouts of AWS's notebooks, scaled to small worlds.
ACCEPTED = [
    (8, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 4}),  # GPT-NeoX, Llama
    (8, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 4, "context_parallel_degree": 2}),
    (8, {"hybrid_shard_degree": 8}),
    (8, {"hybrid_shard_degree": 1, "tensor_parallel_degree": 8}),
    (4, {"hybrid_shard_degree": 2}),
    (4, {"context_parallel_degree": 4}),  # hybrid shard degree 0: world / tp = 4
    (6, {"tensor_parallel_degree": 3, "hybrid_shard_degree": 2}),
]


@pytest.mark.parametrize(("world", "parameters"), ACCEPTED)
def test_degrees_that_tile_the_world(world: int, parameters: dict[str, Any]) -> None:
    validate_smp_v2_parameters(parameters, world_size=world)


REJECTED: list[tuple[int | None, dict[str, Any], type[ConfigError], tuple[str, ...]]] = [
    (None, {"hybrid_shard_degre": 2}, UnknownKeyError, (f"{P}.hybrid_shard_degre: unknown key",
     "'hybrid_shard_degree'")),
    (None, {"partitions": 2}, ConfigError, (f"{P}.partitions", "SMP v1's", '"mpi"',
     "hybrid_shard_degree")),
    (None, {"ddp": True}, ConfigError, (f"{P}.ddp", "SMP v1's")),
    (None, {"hybrid_shard_degree": -1}, ConfigError, (f"{P}.hybrid_shard_degree", "got -1",
     "an integer >= 0")),
    (None, {"tensor_parallel_degree": 0}, ConfigError, ("got 0", "an integer >= 1")),
    (None, {"sm_activation_offloading": 1}, ConfigError, ("got 1", "true or false")),
    (None, {"activation_loading_horizon": 0}, ConfigError, ("got 0", "an integer >= 1")),
    (None, {"expert_parallel_degree": 2}, ConfigError, (f"{P}.expert_parallel_degree", "got 2",
     "exactly 1 (expert parallelism is not available yet in dtrain)")),
    (None, {"random_seed": "1"}, ConfigError, ("got '1'", "an integer >= 0")),
    (None, [("tensor_parallel_degree", 2)], ConfigError, ("a dict of SMP v2 parameters",)),
    (8, {"tensor_parallel_degree": 3}, ConfigError, (f"{P}.tensor_parallel_degree", "got 3",
     "a divisor of the world size 8", "[1, 2, 4, 8]")),
    (8, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 8}, ConfigError, (
     f"{P}.hybrid_shard_degree", "got 8", "world / tensor_parallel_degree = 8 / 2 = 4",
     "[0, 1, 2, 4]")),
    (6, {"hybrid_shard_degree": 4}, ConfigError, ("got 4", "[0, 1, 2, 3, 6]")),
    (8, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "context_parallel_degree": 4},
     ConfigError, (f"{P}.context_parallel_degree", "got 4", "at most the hybrid shard degree",
                   "hybrid_shard_degree 2", "[1, 2]")),
    (8, {"context_parallel_degree": 3}, ConfigError, ("got 3", "world / tp = 8", "[1, 2, 4, 8]")),
]  # fmt: skip


@pytest.mark.parametrize(("world", "parameters", "error", "expected"), REJECTED)
def test_rejected_with_what_is_allowed(
    world: int | None, parameters: Any, error: type[ConfigError], expected: tuple[str, ...]
) -> None:
    with pytest.raises(error) as caught:
        validate_smp_v2_parameters(parameters, world_size=world)
    assert type(caught.value) is error
    for text in expected:
        assert text in str(caught.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [("activation_loading_horizon", 4), ("fsdp_cache_flush_warnings", False),
     ("allow_empty_shards", True)],
)  # fmt: skip
def test_parameters_without_effect_warn(name: str, value: Any) -> None:
    with pytest.warns(UserWarning, match=f"{P}.{name}=.* is accepted without effect"):
        validate_smp_v2_parameters({name: value})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_smp_v2_parameters({name: validate_smp_v2_parameters({})[name]})  # default: quiet


@pytest.mark.parametrize(
    ("world", "parameters", "extent", "native"),
    [
        (8, {}, 8, True),  # the script's FSDP as torch has it
        (8, {"hybrid_shard_degree": 2}, 2, False),
        (8, {"tensor_parallel_degree": 2}, 4, False),  # SMP: the largest, world / tp
        (8, {"context_parallel_degree": 2}, 8, False),
    ],
)
def test_resolved_hybrid_shard_degree(
    world: int, parameters: dict[str, Any], extent: int, native: bool
) -> None:
    values = validate_smp_v2_parameters(parameters, world_size=world)
    assert hybrid_shard_extent(values, world) == extent
    assert runs_native_fsdp(values) is native


def test_schema_markdown_lists_every_parameter() -> None:
    table = schema_markdown()
    for name in SMP_V2_PARAMETER_NAMES:
        assert f"| `{name}` |" in table
    assert "exactly 1 (expert parallelism is not available yet in dtrain)" in table

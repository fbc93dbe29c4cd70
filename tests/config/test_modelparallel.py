"""Model-parallel parameters: defaults as SMP v1 fills them, and errors that say how to fix them."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from dtrain.config.modelparallel import (
    MP_PARAMETER_NAMES,
    PARAMETERS,
    SPECS,
    schema_markdown,
    validate_mp_parameters,
)
from dtrain.errors import ConfigError, UnknownKeyError

P = "parameters"


def test_defaults_filled_in_schema_order() -> None:
    values = validate_mp_parameters({})
    assert tuple(values) == MP_PARAMETER_NAMES
    assert values["pipeline_parallel_degree"] == 1
    assert values["microbatches"] == 1
    assert values["pipeline"] == "interleaved"
    assert values["placement_strategy"] == "cluster"
    assert values["optimize"] == "speed"
    assert values["memory_weight"] == 0.2
    assert values["active_microbatches"] == 1  # pp + 2 = 3, clamped to microbatches
    assert values["ddp"] is False
    assert values["default_partition"] is None
    assert values["sdp_hierarchical_allgather"] is True


def test_derived_defaults_follow_other_parameters() -> None:
    values = validate_mp_parameters({"optimize": "memory", "partitions": 2, "microbatches": 8})
    assert values["memory_weight"] == 0.8
    assert values["active_microbatches"] == 4


def test_partitions_alias_and_agreeing_duplicate() -> None:
    assert validate_mp_parameters({"partitions": 4})["pipeline_parallel_degree"] == 4
    both = validate_mp_parameters({"partitions": 2, "pipeline_parallel_degree": 2})
    assert both["pipeline_parallel_degree"] == 2
    assert "partitions" not in both


def test_a_fixed_order_is_accepted_for_any_number_of_partitions() -> None:
    config = validate_mp_parameters({"deterministic_server": True, "partitions": 4})
    assert config["deterministic_server"] and config["pipeline_parallel_degree"] == 4


def test_value_forms_normalized() -> None:
    values = validate_mp_parameters(
        {
            "ddp": "True",
            "fp16_params": "false",
            "memory_weight": 1,
            "sdp_reduce_bucket_size": 5e8,
            "placement_strategy": "TPD",
        }
    )
    assert values["ddp"] is True
    assert values["fp16_params"] is False
    assert values["memory_weight"] == 1.0 and isinstance(values["memory_weight"], float)
    assert values["sdp_reduce_bucket_size"] == 500_000_000
    assert isinstance(values["sdp_reduce_bucket_size"], int)


def test_fp16_params_implies_fp16() -> None:
    assert validate_mp_parameters({"fp16_params": True})["fp16"] is True


def test_aws_gpt2_example_combination_is_accepted() -> None:
    params = {
        "ddp": True,
        "tensor_parallel_degree": 2,
        "partitions": 2,
        "shard_optimizer_state": True,
        "prescaled_batch": True,
        "fp16": True,
        "optimize": "speed",
        "auto_partition": False,
        "default_partition": 0,
    }
    values = validate_mp_parameters(params, world_size=16, where=P)
    assert values["tensor_parallel_degree"] == 2 and values["pipeline_parallel_degree"] == 2
    params.update(tensor_parallel_degree=1)
    values = validate_mp_parameters(params)
    assert values["default_partition"] == 0


def test_tensor_parallelism_needs_ddp_and_a_degree_dividing_the_world() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree: got 2; allowed: only .*ddp"):
        validate_mp_parameters({"tensor_parallel_degree": 2})
    with pytest.raises(ConfigError, match=r"1 x 4 = 4 must divide the world size 6"):
        validate_mp_parameters({"tensor_parallel_degree": 4, "ddp": True}, world_size=6)


def test_world_size_fits_model_without_ddp() -> None:
    values = validate_mp_parameters({"partitions": 4, "microbatches": 4}, world_size=4)
    assert values["ddp"] is False


def test_what_dtrain_does_not_implement_is_refused_not_ignored() -> None:
    key = "sharded_data_parallel_degree"
    with pytest.raises(ConfigError, match=f"{key}: got 2; allowed: only together with pipeline"):
        validate_mp_parameters({key: 2, "pipeline_parallel_degree": 2, "ddp": True}, world_size=4)
    with pytest.raises(ConfigError, match=r"microbatches: got 1000000000; allowed: .* to 4096"):
        validate_mp_parameters({"microbatches": 10**9})


BAD: list[tuple[dict[str, Any], int | None, type[ConfigError], tuple[str, ...]]] = [
    ({"microbatch": 4}, None, UnknownKeyError, (f"{P}.microbatch", "'microbatches'")),
    ({"partition": 2}, None, UnknownKeyError, (f"{P}.partition", "'partitions'")),
    ({"fast": True}, None, UnknownKeyError, (f"{P}.fast", "allowed keys", "ddp")),
    ({"pipeline": "simpel"}, None, ConfigError, (f"{P}.pipeline", "'simpel'", "'simple'")),
    (
        {"placement_strategy": "dpt"},
        None,
        ConfigError,
        (f"{P}.placement_strategy", "'dpt'", '"spread"', "'DPT'"),
    ),
    ({"optimize": "fast"}, None, ConfigError, (f"{P}.optimize", "'fast'", '"speed", "memory"')),
    ({"microbatches": 0}, None, ConfigError, (f"{P}.microbatches", "got 0", "from 1 to 4096")),
    ({"microbatches": True}, None, ConfigError, (f"{P}.microbatches", "True", "integer")),
    ({"microbatches": "4"}, None, ConfigError, (f"{P}.microbatches", "'4'", "from 1 to 4096")),
    ({"partitions": 2.5}, None, ConfigError, (f"{P}.partitions", "2.5", "integer >= 1")),
    ({"ddp": "yes"}, None, ConfigError, (f"{P}.ddp", "'yes'", "true or false")),
    ({"memory_weight": 1.5}, None, ConfigError, (f"{P}.memory_weight", "1.5", "from 0 to 1")),
    ({"ddp_port": 70000, "ddp": True}, None, ConfigError, (f"{P}.ddp_port", "70000", "65535")),
    (
        {"partitions": 2, "pipeline_parallel_degree": 4},
        None,
        ConfigError,
        (f"{P}.partitions", "got 2", "pipeline_parallel_degree (4)", "alias"),
    ),
    (
        {"auto_partition": False, "partitions": 2},
        None,
        ConfigError,
        (f"{P}.default_partition", "None", "from 0 to 1", "auto_partition is false"),
    ),
    (
        {"default_partition": 2, "partitions": 2},
        None,
        ConfigError,
        (f"{P}.default_partition", "got 2", "from 0 to 1"),
    ),
    ({"ddp_port": 29500}, None, ConfigError, (f"{P}.ddp_port", "29500", "ddp=true")),
    (
        {"ddp_dist_backend": "nccl"},
        None,
        ConfigError,
        (f"{P}.ddp_dist_backend", "'nccl'", "ddp=true"),
    ),
    (
        {"ddp_dist_backend": "gloo", "ddp": True},
        None,
        ConfigError,
        (f"{P}.ddp_dist_backend", "'gloo'", '"auto", "nccl"'),
    ),
    (
        {"ddp": True, "horovod": True},
        None,
        ConfigError,
        (f"{P}.ddp", "True", "horovod=false", "horovod=true"),
    ),
    ({"bf16": True, "fp16": True}, None, ConfigError, (f"{P}.bf16", "True", "fp16=false")),
    (
        {"bf16": True, "fp16_params": True},
        None,
        ConfigError,
        (f"{P}.bf16", "True", "fp16_params=false"),
    ),
    (
        {"prescaled_batch": True, "optimize": "memory"},
        None,
        ConfigError,
        (f"{P}.prescaled_batch", "True", 'optimize="speed"', 'optimize="memory"'),
    ),
    (
        {"shard_optimizer_state": True},
        None,
        ConfigError,
        (f"{P}.shard_optimizer_state", "True", "ddp=true"),
    ),
    (
        {"active_microbatches": 5, "microbatches": 4},
        None,
        ConfigError,
        (f"{P}.active_microbatches", "got 5", "from 1 to microbatches (4)"),
    ),
    (
        {"partitions": 4, "ddp": True},
        6,
        ConfigError,
        (f"{P}.pipeline_parallel_degree", "4 x 1 = 4", "world size 6"),
    ),
    (
        {"partitions": 2},
        8,
        ConfigError,
        (f"{P}.ddp", "got False", "= 4 replicas", "set ddp: true"),
    ),
]


@pytest.mark.parametrize(("params", "world_size", "error", "expected"), BAD)
def test_bad_parameters(
    params: dict[str, Any],
    world_size: int | None,
    error: type[ConfigError],
    expected: tuple[str, ...],
) -> None:
    with pytest.raises(error) as caught:
        validate_mp_parameters(params, world_size=world_size)
    assert type(caught.value) is error
    for text in expected:
        assert text in str(caught.value)


def test_smps_internal_parameters_are_accepted_and_ignored_with_a_warning() -> None:
    with pytest.warns(UserWarning, match=rf"^{P}\.static_mode is one of SMP's internal"):
        values = validate_mp_parameters({"static_mode": True, "microbatches": 2})
    assert "static_mode" not in values and values["microbatches"] == 2


def test_where_prefixes_every_key() -> None:
    where = "distribution.smdistributed.modelparallel.parameters"
    with pytest.raises(UnknownKeyError, match=rf"^{where}\.microbatch: unknown key"):
        validate_mp_parameters({"microbatch": 2}, where=where)


def test_parameters_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="parameters: got \\[1\\]; allowed: a dict"):
        validate_mp_parameters([1])  # type: ignore[arg-type]


def test_schema_markdown_lists_every_parameter() -> None:
    table = schema_markdown()
    assert len(PARAMETERS) == len(MP_PARAMETER_NAMES)
    for name in MP_PARAMETER_NAMES:
        assert f"| `{name}`" in table
    assert "(alias `partitions`)" in table
    assert "0.2 if optimize is speed, else 0.8" in table


WITHOUT_EFFECT: dict[str, dict[str, Any]] = {
    "contiguous": {"contiguous": False},
    "horovod": {"horovod": True},
    "ddp_port": {"ddp": True, "ddp_port": 29500},
    "ddp_dist_backend": {"ddp": True, "ddp_dist_backend": "nccl"},
    "activation_loading_horizon": {"activation_loading_horizon": 2},
    "skip_tracing": {"skip_tracing": True},
    "sdp_reduce_bucket_size": {"sdp_reduce_bucket_size": 1000},
    "sdp_max_live_parameters": {"sdp_max_live_parameters": 1000},
    "sdp_hierarchical_allgather": {"sdp_hierarchical_allgather": False},
}
"""Each parameter dtrain accepts without effect, set away from its default."""


def test_every_parameter_without_effect_is_tried() -> None:
    assert set(WITHOUT_EFFECT) == {s.name for s in PARAMETERS if s.without_effect is not None}


@pytest.mark.parametrize("name", WITHOUT_EFFECT)
def test_a_parameter_without_effect_warns_once_naming_what_dtrain_does_instead(name: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_mp_parameters(WITHOUT_EFFECT[name], where=P)
    said = [str(w.message) for w in caught]
    instead = SPECS[name].without_effect
    assert said == [
        f"{P}.{name}={json.dumps(WITHOUT_EFFECT[name][name])} is accepted without effect: {instead}"
    ]


def test_parameters_without_effect_left_at_their_defaults_say_nothing() -> None:
    defaults = {name: SPECS[name].default for name in WITHOUT_EFFECT}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_mp_parameters({**defaults, "ddp": True}, where=P)

"""The ``distribution`` dict: resolved like SageMaker's SDK, wrong forms rejected with a fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dtrain.config.distribution import DistributionPlan, load_distribution, resolve_distribution
from dtrain.errors import ConfigError, UnknownKeyError

MP = "distribution.smdistributed.modelparallel"
SMP_V1 = {
    "smdistributed": {
        "modelparallel": {
            "enabled": True,
            "parameters": {
                "microbatches": 4,
                "placement_strategy": "spread",
                "pipeline": "interleaved",
                "optimize": "speed",
                "partitions": 2,
                "ddp": True,
            },
        }
    },
    "mpi": {
        "enabled": True,
        "processes_per_host": 4,
        "custom_mpi_options": "--mca btl_vader_single_copy_mechanism none ",
    },
}


def resolve(
    distribution: Any,
    instance_count: int = 1,
    processes_per_host: int | None = None,
    default: int = 2,
    instance_type: str = "local",
) -> DistributionPlan:
    return resolve_distribution(
        distribution,
        instance_count=instance_count,
        processes_per_host=processes_per_host,
        default_processes_per_host=default,
        instance_type=instance_type,
    )


def test_no_distribution_uses_the_default_processes_per_host() -> None:
    for empty in (None, {}):
        plan = resolve(empty, instance_count=3, default=4)
        assert plan == DistributionPlan("none", 3, 4, None, {})
        assert plan.world_size == 12


def test_no_distribution_honours_explicit_processes() -> None:
    assert resolve(None, processes_per_host=3).world_size == 3


def test_mpi_hyperparameters_as_sagemaker_sets_them() -> None:
    plan = resolve({"mpi": {"enabled": True, "processes_per_host": 4}}, instance_count=2)
    assert plan.strategy == "mpi"
    assert plan.world_size == 8
    assert plan.mp_parameters is None
    assert plan.framework_hyperparameters == {
        "sagemaker_mpi_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 4,
        "sagemaker_mpi_custom_mpi_options": "",
    }


def test_mpi_without_processes_uses_default_and_omits_count() -> None:
    plan = resolve({"mpi": {"enabled": True, "custom_mpi_options": "-x A=1"}}, default=3)
    assert plan.processes_per_host == 3
    assert plan.framework_hyperparameters == {
        "sagemaker_mpi_enabled": True,
        "sagemaker_mpi_custom_mpi_options": "-x A=1",
    }


def test_mpi_processes_from_flag() -> None:
    plan = resolve({"mpi": {"enabled": True}}, processes_per_host=2, default=8)
    assert plan.processes_per_host == 2
    assert plan.framework_hyperparameters["sagemaker_mpi_num_of_processes_per_host"] == 2


def test_disabled_mpi_still_reported_like_the_sdk() -> None:
    plan = resolve({"mpi": {"enabled": False}})
    assert plan.strategy == "none"
    assert plan.framework_hyperparameters == {
        "sagemaker_mpi_enabled": False,
        "sagemaker_mpi_custom_mpi_options": "",
    }


def test_smdataparallel() -> None:
    plan = resolve(
        {"smdistributed": {"dataparallel": {"enabled": True}}},
        instance_count=2,
        default=4,
        instance_type="local_gpu",
    )
    assert plan.strategy == "smdistributed.dataparallel"
    assert plan.world_size == 8
    assert plan.framework_hyperparameters == {
        "sagemaker_distributed_dataparallel_enabled": True,
        "sagemaker_instance_type": "local_gpu",
        "sagemaker_distributed_dataparallel_custom_mpi_options": "",
    }


def test_pytorchddp_is_rewritten_to_smdataparallel() -> None:
    plan = resolve({"pytorchddp": {"enabled": True, "custom_mpi_options": "-x B=2"}})
    assert plan.strategy == "smdistributed.dataparallel"
    assert plan.framework_hyperparameters["sagemaker_distributed_dataparallel_enabled"] is True
    assert (
        plan.framework_hyperparameters["sagemaker_distributed_dataparallel_custom_mpi_options"]
        == "-x B=2"
    )


def test_torch_distributed() -> None:
    plan = resolve({"torch_distributed": {"enabled": True}}, instance_count=2, default=1)
    assert plan.strategy == "torch_distributed"
    assert plan.world_size == 2
    assert plan.framework_hyperparameters == {
        "sagemaker_torch_distributed_enabled": True,
        "sagemaker_instance_type": "local",
    }


def test_smp_v2_pairs_modelparallel_with_torch_distributed() -> None:
    """AWS's notebooks' distribution (GPT-NeoX, Llama): torchrun with SMP v2's parameters."""
    parameters = {
        "activation_loading_horizon": 2,
        "hybrid_shard_degree": 4,
        "sm_activation_offloading": True,
        "tensor_parallel_degree": 2,
    }
    plan = resolve(smp_v2(parameters), instance_count=2, default=4, instance_type="ml.p4d.24xlarge")
    assert plan.strategy == "torch_distributed"
    assert plan.world_size == 8
    assert plan.mp_parameters is not None
    assert plan.mp_parameters["hybrid_shard_degree"] == 4
    assert plan.mp_parameters["context_parallel_degree"] == 1  # defaults filled in
    assert plan.framework_hyperparameters == {
        "sagemaker_torch_distributed_enabled": True,
        "sagemaker_instance_type": "ml.p4d.24xlarge",
        "sagemaker_distributed_dataparallel_enabled": False,
        "mp_parameters": parameters,
    }


def test_smp_v1_canonical_launch() -> None:
    plan = resolve(SMP_V1, instance_count=2, instance_type="ml.p3.16xlarge")
    assert plan.strategy == "smdistributed.modelparallel"
    assert plan.world_size == 8
    assert plan.mp_parameters is not None
    assert plan.mp_parameters["pipeline_parallel_degree"] == 2
    assert plan.mp_parameters["active_microbatches"] == 4
    assert plan.framework_hyperparameters == {
        "sagemaker_mpi_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 4,
        "sagemaker_mpi_custom_mpi_options": "--mca btl_vader_single_copy_mechanism none ",
        "sagemaker_distributed_dataparallel_enabled": False,
        "sagemaker_instance_type": "ml.p3.16xlarge",
        "mp_parameters": SMP_V1["smdistributed"]["modelparallel"]["parameters"],
    }


def test_mp_parameters_from_a_json_file(tmp_path: Path) -> None:
    params = tmp_path / "smp.json"
    params.write_text(json.dumps({"partitions": 2, "microbatches": 2}))
    distribution = {
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": str(params)}},
        "mpi": {"enabled": True, "processes_per_host": 2},
    }
    plan = resolve(distribution)
    assert plan.mp_parameters is not None
    assert plan.mp_parameters["pipeline_parallel_degree"] == 2
    assert plan.framework_hyperparameters["mp_parameters"] == {"partitions": 2, "microbatches": 2}


def test_load_distribution_from_text_and_file(tmp_path: Path) -> None:
    text = json.dumps(SMP_V1)
    assert load_distribution(text) == SMP_V1
    path = tmp_path / "distribution.json"
    path.write_text(text)
    assert load_distribution(str(path)) == SMP_V1
    assert resolve(str(path), instance_count=2).strategy == "smdistributed.modelparallel"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"mpi": {"enabled": true', ("distribution:", "invalid JSON")),
        ("no/such/file.json", ("distribution:", "'no/such/file.json'", "no such file")),
        ("[1, 2]", ("distribution:", "got a JSON list, not an object")),
    ],
)
def test_load_distribution_errors(text: str, expected: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_distribution(text)
    for part in (*expected, "JSON text, or the path of a JSON file"):
        assert part in str(caught.value)


def test_load_distribution_rejects_non_object_file(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1]")
    with pytest.raises(ConfigError, match="got a JSON list, not an object"):
        load_distribution(str(path))


def smp(parameters: Any, mpi: Any = None) -> dict[str, Any]:
    """An SMP v1 distribution with these parameters and (by default) 2 MPI processes per host."""
    return {
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
        "mpi": {"enabled": True, "processes_per_host": 2} if mpi is None else mpi,
    }


def smp_v2(parameters: Any) -> dict[str, Any]:
    """An SMP v2 distribution (modelparallel under torchrun) with these parameters."""
    return {
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
        "torch_distributed": {"enabled": True},
    }


BAD: list[tuple[Any, dict[str, Any], type[ConfigError], tuple[str, ...]]] = [
    (
        {"mpi": {"enabled": True, "process_per_host": 4}},
        {},
        UnknownKeyError,
        ("distribution.mpi.process_per_host", "'processes_per_host'", "custom_mpi_options"),
    ),
    (
        {"smdistribute": {}},
        {},
        UnknownKeyError,
        ("distribution.smdistribute", "'smdistributed'", "torch_distributed"),
    ),
    (
        {"smdistributed": {"modelparalel": {"enabled": True}}},
        {},
        UnknownKeyError,
        ("distribution.smdistributed.modelparalel", "'modelparallel'", "dataparallel"),
    ),
    (
        {"torch_distributed": {"enable": True}},
        {},
        UnknownKeyError,
        ("distribution.torch_distributed.enable", "'enabled'"),
    ),
    (
        {"mpi": {"enabled": "true"}},
        {},
        ConfigError,
        ("distribution.mpi.enabled", "'true'", "true or false"),
    ),
    (
        {"mpi": {"processes_per_host": 4}},
        {},
        ConfigError,
        ("distribution.mpi:", "'processes_per_host': 4", '"enabled": true'),
    ),
    ({"mpi": True}, {}, ConfigError, ("distribution.mpi:", "True", '{"enabled": true}')),
    (
        {"mpi": {"enabled": True, "processes_per_host": 0}},
        {},
        ConfigError,
        ("distribution.mpi.processes_per_host", "got 0", "integer >= 1"),
    ),
    (
        {"mpi": {"enabled": True, "processes_per_host": 4}},
        {"processes_per_host": 2},
        ConfigError,
        ("distribution.mpi.processes_per_host", "got 4", "processes_per_host (2)"),
    ),
    (
        {"mpi": {"enabled": True, "custom_mpi_options": ["-x", "A"]}},
        {},
        ConfigError,
        ("distribution.mpi.custom_mpi_options", "['-x', 'A']", "a string"),
    ),
    (None, {"instance_count": 0}, ConfigError, ("instance_count", "got 0", "integer >= 1")),
    (None, {"processes_per_host": -1}, ConfigError, ("processes_per_host", "-1", ">= 1")),
    (
        {
            "smdistributed": {
                "dataparallel": {"enabled": True},
                "modelparallel": {"enabled": True},
            },
            "mpi": {"enabled": True},
        },
        {},
        ConfigError,
        ("distribution.smdistributed", "only one smdistributed strategy enabled at a time"),
    ),
    (
        {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {}}}},
        {},
        ConfigError,
        ("distribution.mpi", "got None", '"mpi": {"enabled": true'),
    ),
    (
        smp({}, mpi={"enabled": False}),
        {},
        ConfigError,
        ("distribution.mpi", "{'enabled': False}", "for SMP v1", '"torch_distributed"', "SMP v2"),
    ),
    (
        {**smp({}), "torch_distributed": {"enabled": True}},
        {},
        ConfigError,
        (
            "distribution.torch_distributed",
            "mpi and torch_distributed",
            "torch_distributed for SMP",
        ),
    ),
    (
        smp({"hybrid_shard_degree": 2}),
        {},
        ConfigError,
        (f"{MP}.parameters.hybrid_shard_degree", "SMP v2's", '"torch_distributed": {"enabled"'),
    ),
    (
        smp_v2({"partitions": 2}),
        {},
        ConfigError,
        (f"{MP}.parameters.partitions", "SMP v1's", '"mpi": {"enabled": true}'),
    ),
    (
        smp_v2({"hybrid_shard_degre": 2}),
        {},
        UnknownKeyError,
        (f"{MP}.parameters.hybrid_shard_degre", "'hybrid_shard_degree'"),
    ),
    (
        smp_v2({"hybrid_shard_degree": 3}),
        {"instance_count": 2, "processes_per_host": 2},
        ConfigError,
        (f"{MP}.parameters.hybrid_shard_degree", "got 3", "world / tensor_parallel_degree = 4"),
    ),
    (
        {
            "smdistributed": {"dataparallel": {"enabled": True}},
            "torch_distributed": {"enabled": True},
        },
        {},
        ConfigError,
        ("distribution.torch_distributed", "smdistributed.dataparallel and torch_distributed"),
    ),
    (
        {"pytorchddp": {"enabled": True}, "smdistributed": {"dataparallel": {"enabled": True}}},
        {},
        ConfigError,
        ("distribution.pytorchddp", "{'enabled': True}", "give only one"),
    ),
    (
        {"pytorchddp": {"enabled": True, "custom_mpi_option": ""}},
        {},
        UnknownKeyError,
        ("distribution.pytorchddp.custom_mpi_option", "'custom_mpi_options'"),
    ),
    (
        {"parameter_server": {"enabled": True}},
        {},
        ConfigError,
        ("distribution.parameter_server", "{'enabled': True}", "TensorFlow", "PyTorch"),
    ),
    (
        {"multi_worker_mirrored_strategy": {"enabled": True}},
        {},
        ConfigError,
        ("distribution.multi_worker_mirrored_strategy", "not supported", "TensorFlow"),
    ),
    (
        {"pytorchxla": {"enabled": True}},
        {},
        ConfigError,
        ("distribution.pytorchxla", "not supported", "XLA"),
    ),
    (
        {"instance_groups": ["train"], "mpi": {"enabled": True}},
        {},
        ConfigError,
        ("distribution.instance_groups", "['train']", "homogeneous", "instance_count"),
    ),
    (
        smp({"microbatch": 4}),
        {},
        UnknownKeyError,
        (f"{MP}.parameters.microbatch", "'microbatches'"),
    ),
    (
        smp({"partitions": 3, "ddp": True}),
        {"instance_count": 2},
        ConfigError,
        (f"{MP}.parameters.pipeline_parallel_degree", "1 = 3", "world size 4"),
    ),
    (
        smp({"partitions": 2}),
        {"instance_count": 2},
        ConfigError,
        (f"{MP}.parameters.ddp", "got False", "2 replicas", "set ddp: true"),
    ),
    (
        smp(42),
        {},
        ConfigError,
        (f"{MP}.parameters", "got 42", "a dict of model-parallel parameters"),
    ),
    (
        smp("missing.json"),
        {},
        ConfigError,
        (f"{MP}.parameters", "'missing.json'", "no such file"),
    ),
]


@pytest.mark.parametrize(("distribution", "kwargs", "error", "expected"), BAD)
def test_bad_distributions(
    distribution: Any,
    kwargs: dict[str, Any],
    error: type[ConfigError],
    expected: tuple[str, ...],
) -> None:
    with pytest.raises(error) as caught:
        resolve(distribution, **kwargs)
    assert type(caught.value) is error
    for text in expected:
        assert text in str(caught.value)


def test_mpi_and_flag_may_agree() -> None:
    plan = resolve({"mpi": {"enabled": True, "processes_per_host": 2}}, processes_per_host=2)
    assert plan.processes_per_host == 2


def test_local_gpu_multi_instance_allowed() -> None:
    plan = resolve(
        {"smdistributed": {"dataparallel": {"enabled": True}}},
        instance_count=2,
        instance_type="local_gpu",
    )
    assert plan.world_size == 4


def test_disabled_modelparallel_parameters_are_not_validated() -> None:
    plan = resolve({"smdistributed": {"modelparallel": {"enabled": False, "parameters": 1}}})
    assert plan.strategy == "none"
    assert plan.mp_parameters is None
    assert plan.framework_hyperparameters == {
        "sagemaker_distributed_dataparallel_enabled": False,
        "sagemaker_instance_type": "local",
    }

"""Hyperparameters reach the script exactly as SageMaker's toolkit passes them."""

from __future__ import annotations

import json

from dtrain.jobs.hyperparameters import (
    framework_parameters,
    to_cmd_args,
    to_env,
    to_json_file_content,
    user_hyperparameters,
)

HPS = {
    "epochs": 1,
    "mp_parameters": {"partitions": 2, "ddp": True},
    "b": "x",
    "lr": 0.5,
    "flag": False,
    "none": None,
    "batch-size": 32,
    "sagemaker_mpi_enabled": True,
}


def test_cmd_args_sorted_dicts_flattened_reserved_hidden() -> None:
    assert to_cmd_args(HPS) == [
        "-b", "x",
        "--batch-size", "32",
        "--epochs", "1",
        "--flag", "False",
        "--lr", "0.5",
        "--mp_parameters", "ddp=True,partitions=2",
        "--none", "",
    ]  # fmt: skip


def test_sagemaker_documented_example() -> None:
    args = to_cmd_args({"epochs": 1, "mp_parameters": {"ddp": True, "partitions": 2}})
    assert " ".join(args) == "--epochs 1 --mp_parameters ddp=True,partitions=2"


def test_env_variables() -> None:
    env = to_env(HPS)
    assert env["SM_HP_EPOCHS"] == "1"
    assert env["SM_HP_B"] == "x"
    assert env["SM_HP_BATCH-SIZE"] == "32"
    assert env["SM_HP_FLAG"] == "false"
    assert env["SM_HP_MP_PARAMETERS"] == '{"ddp":true,"partitions":2}'
    assert "SM_HP_SAGEMAKER_MPI_ENABLED" not in env
    assert json.loads(env["SM_HPS"]) == user_hyperparameters(HPS)


def test_json_file_values_are_json_strings() -> None:
    content = to_json_file_content({"a": "x", "n": 2, "d": {"k": 1}})
    assert content == {"a": '"x"', "n": "2", "d": '{"k": 1}'}
    assert {k: json.loads(v) for k, v in content.items()} == {"a": "x", "n": 2, "d": {"k": 1}}


def test_framework_parameters_split() -> None:
    assert framework_parameters(HPS) == {"sagemaker_mpi_enabled": True}

"""Hyperparameters the way SageMaker hands them to a training script.

As a JSON file, as SM_* variables and as CLI args.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

RESERVED_PREFIX = "sagemaker_"


def _compact_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def user_hyperparameters(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """The user's own hyperparameters: SageMaker hides its ``sagemaker_*`` keys from scripts."""
    return {k: v for k, v in hyperparameters.items() if not k.startswith(RESERVED_PREFIX)}


def framework_parameters(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    """The ``sagemaker_*`` keys, exposed as ``SM_FRAMEWORK_PARAMS``."""
    return {k: v for k, v in hyperparameters.items() if k.startswith(RESERVED_PREFIX)}


def _arg_value(value: Any) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    if value is None:
        return ""
    return str(value)


def to_cmd_args(hyperparameters: Mapping[str, Any]) -> list[str]:
    """Sorted ``--key value`` pairs (``-k`` for one letter).

    Dicts become ``k=v,k=v``, as SageMaker does.
    """
    args: list[str] = []
    for key in sorted(user_hyperparameters(hyperparameters)):
        args.append(f"--{key}" if len(key) > 1 else f"-{key}")
        args.append(_arg_value(hyperparameters[key]))
    return args


def to_json_file_content(hyperparameters: Mapping[str, Any]) -> dict[str, str]:
    """``hyperparameters.json``.

    The SDK JSON-encodes every value, so the file maps keys to JSON strings.
    """
    return {k: json.dumps(v) for k, v in hyperparameters.items()}


def to_env(hyperparameters: Mapping[str, Any]) -> dict[str, str]:
    """``SM_HPS`` and one ``SM_HP_<NAME>`` per user hyperparameter.

    Strings are kept as-is, other values become JSON.
    """
    user = user_hyperparameters(hyperparameters)
    env = {"SM_HPS": _compact_json(user)}
    for key, value in user.items():
        env[f"SM_HP_{key.upper()}"] = env_value(value)
    return env


def env_value(value: Any) -> str:
    """How SageMaker writes any non-string ``SM_*`` value: compact, key-sorted JSON."""
    return value if isinstance(value, str) else _compact_json(value)

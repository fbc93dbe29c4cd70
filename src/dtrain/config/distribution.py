"""SageMaker's ``distribution`` dict, validated and resolved to a strategy and its hyperparameters.

Accepts the forms of the SageMaker Python SDK's PyTorch estimator. dtrain is stricter than the SDK
only where SageMaker would silently mishandle a configuration:

* unknown keys are errors (the SDK ignores a misspelled ``process_per_host``);
* a strategy section with settings but no ``enabled`` key is an error (the SDK ignores the section);
* at most one launcher may be enabled: ``mpi``, ``smdistributed.dataparallel`` (which starts its
  own MPI job) or ``torch_distributed``; model parallelism runs under one of two: ``mpi`` is SMP
  v1 (``smdistributed.modelparallel``), ``torch_distributed`` is SMP v2 (``torch.sagemaker``),
  each with its own parameters (a parameter of the other names the other pairing).

Processes per host default to ``default_processes_per_host`` (the launcher passes the GPUs per
host, else 1) for every strategy, including none, as ``dtrain run --processes-per-host`` documents.
The ``mp_parameters`` hyperparameter carries the user's own
parameters as SageMaker passes them (``SM_HP_MP_PARAMETERS``); the plan holds the normalized ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.config.modelparallel import validate_mp_parameters
from dtrain.config.smpv2 import V2_ONLY_NAMES, V2_PAIRING, validate_smp_v2_parameters
from dtrain.errors import ConfigError, UnknownKeyError

SECTION_KEYS: dict[str, tuple[str, ...]] = {
    "mpi": ("enabled", "processes_per_host", "custom_mpi_options"),
    "dataparallel": ("enabled", "custom_mpi_options"),
    "modelparallel": ("enabled", "parameters"),
    "torch_distributed": ("enabled",),
}
UNSUPPORTED = {
    "parameter_server": "a TensorFlow/MXNet strategy",
    "multi_worker_mirrored_strategy": "a TensorFlow strategy",
    "pytorchxla": "a Training Compiler (XLA) strategy",
}
TOP_LEVEL_KEYS = (
    "smdistributed",
    "mpi",
    "torch_distributed",
    "pytorchddp",
    *UNSUPPORTED,
    "instance_groups",
)
WHERE = "distribution"


@dataclass(frozen=True)
class DistributionPlan:
    """How a job runs: which launcher, how many processes, and the hyperparameters SageMaker adds.

    ``strategy`` is one of ``none``, ``mpi``, ``smdistributed.dataparallel``,
    ``smdistributed.modelparallel`` (SMP v1, under MPI) or ``torch_distributed`` (torchrun's;
    SMP v2 when ``mp_parameters`` is set).
    """

    strategy: str
    instance_count: int
    processes_per_host: int
    mp_parameters: dict[str, Any] | None
    framework_hyperparameters: dict[str, Any]

    @property
    def world_size(self) -> int:
        return self.instance_count * self.processes_per_host


def _read_json_object(text: str, key: str, what: str) -> dict[str, Any]:
    """A JSON object from ``text``, or from the file ``text`` names; ``key`` is for errors."""
    allowed = f"{what} as JSON text, or the path of a JSON file holding one"
    if text.lstrip()[:1] in ("{", "["):
        source = text
    else:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(key, text, f"{allowed} (no such file)")
        source = path.read_text()
    try:
        value = json.loads(source)
    except json.JSONDecodeError as error:
        raise ConfigError(key, text, f"{allowed} (invalid JSON: {error})") from None
    except RecursionError:
        raise ConfigError(key, text[:40] + "...", f"{allowed} (nested less deeply)") from None
    if not isinstance(value, dict):
        raise ConfigError(
            key, text, f"{allowed} (got a JSON {type(value).__name__}, not an object)"
        )
    return value


def load_distribution(text_or_path: str) -> dict[str, Any]:
    """The CLI's ``--distribution``: inline JSON, or a JSON file."""
    return _read_json_object(text_or_path, WHERE, "a distribution dict")


def _section(
    distribution: Mapping[str, Any], name: str, where: str, known: tuple[str, ...]
) -> dict[str, Any]:
    """One strategy's dict, keys checked; ``{}`` when absent."""
    section = distribution.get(name, {})
    if not isinstance(section, Mapping):
        raise ConfigError(where, section, 'a dict such as {"enabled": true}')
    for key in section:
        if key not in known:
            raise UnknownKeyError(where, str(key), known)
    return dict(section)


def _enabled(section: Mapping[str, Any], where: str) -> bool:
    """``enabled`` as a real bool; settings without it would be silently ignored by SageMaker."""
    if "enabled" not in section:
        if section:
            raise ConfigError(
                where,
                dict(section),
                'a section with "enabled": true (without it SageMaker ignores these settings)',
            )
        return False
    enabled = section["enabled"]
    if not isinstance(enabled, bool):
        raise ConfigError(f"{where}.enabled", enabled, "true or false")
    return enabled


def _custom_mpi_options(section: Mapping[str, Any], where: str) -> str:
    options = section.get("custom_mpi_options", "")
    if not isinstance(options, str):
        raise ConfigError(
            f"{where}.custom_mpi_options", options, "a string of extra mpirun options"
        )
    return options


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "an integer >= 1")
    return value


def _reject_unsupported(distribution: Mapping[str, Any]) -> None:
    for key in distribution:
        if key not in TOP_LEVEL_KEYS:
            raise UnknownKeyError(WHERE, str(key), TOP_LEVEL_KEYS)
    for key, kind in UNSUPPORTED.items():
        if key in distribution:
            raise ConfigError(
                f"{WHERE}.{key}",
                distribution[key],
                f"not supported: {key} is {kind} and dtrain runs PyTorch jobs; "
                "use mpi, smdistributed or torch_distributed",
            )
    if "instance_groups" in distribution:
        raise ConfigError(
            f"{WHERE}.instance_groups",
            distribution["instance_groups"],
            "not supported: dtrain runs homogeneous clusters only; "
            "remove it and use instance_count",
        )


def _smdistributed(distribution: Mapping[str, Any]) -> Mapping[str, Any]:
    """``smdistributed``, with ``pytorchddp`` rewritten into it as the SageMaker SDK does."""
    if "pytorchddp" not in distribution:
        return _section(
            distribution,
            "smdistributed",
            f"{WHERE}.smdistributed",
            ("dataparallel", "modelparallel"),
        )
    if "smdistributed" in distribution:
        raise ConfigError(
            f"{WHERE}.pytorchddp",
            distribution["pytorchddp"],
            "not together with smdistributed: pytorchddp means smdistributed.dataparallel; "
            "give only one",
        )
    return {
        "dataparallel": _section(
            distribution, "pytorchddp", f"{WHERE}.pytorchddp", SECTION_KEYS["dataparallel"]
        )
    }


def _load_mp_parameters(section: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``parameters`` as given: a dict, or the path of a JSON file holding one."""
    params = section.get("parameters", {})
    if isinstance(params, str):
        return _read_json_object(params, where, "a dict of model-parallel parameters")
    if not isinstance(params, Mapping):
        raise ConfigError(where, params, "a dict of model-parallel parameters, or a JSON file path")
    return dict(params)


def _choose_strategy(
    mpi: Mapping[str, Any] | None, mpi_on: bool, data: bool, model: bool, torch_distributed: bool
) -> str:
    """The one strategy the enabled sections describe; model parallelism is SMP v1 under MPI,
    SMP v2 under torch_distributed."""
    sm = f"{WHERE}.smdistributed"
    if data and model:
        raise ConfigError(
            sm,
            "dataparallel and modelparallel",
            "only one smdistributed strategy enabled at a time",
        )
    if model and not (mpi_on or torch_distributed):
        raise ConfigError(
            f"{WHERE}.mpi",
            mpi,
            'a launcher for model parallelism: "mpi": {"enabled": true, "processes_per_host": N} '
            'for SMP v1 (smdistributed.modelparallel), or "torch_distributed": {"enabled": true} '
            "for SMP v2 (torch.sagemaker)",
        )
    enabled = [
        name
        for name, on in (
            ("mpi", mpi_on),
            ("smdistributed.dataparallel", data),
            ("torch_distributed", torch_distributed),
        )
        if on
    ]
    if len(enabled) > 1:
        raise ConfigError(
            f"{WHERE}.{enabled[1]}",
            {"enabled": True},
            f"one launcher at a time: {' and '.join(enabled)} are both enabled; keep one"
            + (" (mpi for SMP v1, torch_distributed for SMP v2)" if model else ""),
        )
    if model and mpi_on:
        return "smdistributed.modelparallel"
    return enabled[0] if enabled else "none"


def _smp_v1_parameters(
    parameters: Mapping[str, Any], world_size: int, where: str
) -> dict[str, Any]:
    """SMP v1's parameters (modelparallel under mpi); one of SMP v2's names the v2 pairing."""
    for key in parameters:
        if key in V2_ONLY_NAMES:
            raise ConfigError(
                f"{where}.{key}",
                parameters[key],
                f"an SMP v1 parameter under mpi; {key} is SMP v2's, whose jobs pair "
                f"modelparallel with {V2_PAIRING}",
            )
    return validate_mp_parameters(parameters, world_size=world_size, where=where)


def _processes_per_host(
    mpi: Mapping[str, Any], mpi_enabled: bool, flag: int | None, default: int
) -> tuple[int, int | None]:
    """Resolved processes per host, and the explicitly given value (``None`` when defaulted)."""
    key = f"{WHERE}.mpi.processes_per_host"
    from_mpi = (
        _positive_int(mpi["processes_per_host"], key) if "processes_per_host" in mpi else None
    )
    if flag is not None:
        _positive_int(flag, "processes_per_host")
    if mpi_enabled and from_mpi is not None:
        if flag is not None and flag != from_mpi:
            raise ConfigError(
                key,
                from_mpi,
                f"the same value as processes_per_host ({flag}) given to the job, or leave one out",
            )
        return from_mpi, from_mpi
    if flag is not None:
        return flag, flag
    return default, None


def resolve_distribution(
    distribution: Mapping[str, Any] | str | None,
    *,
    instance_count: int,
    processes_per_host: int | None,
    default_processes_per_host: int,
    instance_type: str = "local",
) -> DistributionPlan:
    """Check a ``distribution`` (dict, JSON text or file) and resolve it to a plan.

    ``processes_per_host`` is the caller's explicit value (the CLI flag) or ``None``;
    ``default_processes_per_host`` is used when neither it nor ``mpi.processes_per_host`` is given
    (SageMaker uses one process per GPU).
    """
    _positive_int(instance_count, "instance_count")
    if isinstance(distribution, str):
        distribution = load_distribution(distribution)
    distribution = distribution or {}
    if not isinstance(distribution, Mapping):
        raise ConfigError(
            WHERE, distribution, 'a dict of strategies, e.g. {"mpi": {"enabled": true}}'
        )
    _reject_unsupported(distribution)

    mpi = _section(distribution, "mpi", f"{WHERE}.mpi", SECTION_KEYS["mpi"])
    mpi_enabled = _enabled(mpi, f"{WHERE}.mpi")
    mpi_options = _custom_mpi_options(mpi, f"{WHERE}.mpi")
    smdistributed = _smdistributed(distribution)
    sm_where = (
        f"{WHERE}.pytorchddp"
        if "pytorchddp" in distribution
        else f"{WHERE}.smdistributed.dataparallel"
    )
    data = _section(smdistributed, "dataparallel", sm_where, SECTION_KEYS["dataparallel"])
    data_enabled = _enabled(data, sm_where)
    data_options = _custom_mpi_options(data, sm_where)
    mp_where = f"{WHERE}.smdistributed.modelparallel"
    model = _section(smdistributed, "modelparallel", mp_where, SECTION_KEYS["modelparallel"])
    model_enabled = _enabled(model, mp_where)
    torch_section = _section(
        distribution,
        "torch_distributed",
        f"{WHERE}.torch_distributed",
        SECTION_KEYS["torch_distributed"],
    )
    torch_enabled = _enabled(torch_section, f"{WHERE}.torch_distributed")

    strategy = _choose_strategy(
        distribution.get("mpi"), mpi_enabled, data_enabled, model_enabled, torch_enabled
    )
    ppn, explicit_ppn = _processes_per_host(
        mpi, mpi_enabled, processes_per_host, default_processes_per_host
    )

    hyperparameters: dict[str, Any] = {}
    mp_parameters: dict[str, Any] | None = None
    if strategy == "torch_distributed":
        hyperparameters["sagemaker_torch_distributed_enabled"] = True
        hyperparameters["sagemaker_instance_type"] = instance_type
        if model_enabled:  # as the SDK adds it for any smdistributed section
            hyperparameters["sagemaker_distributed_dataparallel_enabled"] = False
    else:
        if "mpi" in distribution:
            hyperparameters["sagemaker_mpi_enabled"] = mpi_enabled
            if mpi_enabled and explicit_ppn is not None:
                hyperparameters["sagemaker_mpi_num_of_processes_per_host"] = explicit_ppn
            hyperparameters["sagemaker_mpi_custom_mpi_options"] = mpi_options
        if "smdistributed" in distribution or "pytorchddp" in distribution:
            hyperparameters["sagemaker_distributed_dataparallel_enabled"] = data_enabled
            hyperparameters["sagemaker_instance_type"] = instance_type
            if data_enabled:
                hyperparameters["sagemaker_distributed_dataparallel_custom_mpi_options"] = (
                    data_options
                )
    if model_enabled:
        params_where = f"{mp_where}.parameters"
        user_parameters = _load_mp_parameters(model, params_where)
        validate = (
            _smp_v1_parameters
            if strategy == "smdistributed.modelparallel"
            else validate_smp_v2_parameters
        )
        mp_parameters = validate(
            user_parameters, world_size=instance_count * ppn, where=params_where
        )
        hyperparameters["mp_parameters"] = user_parameters
    return DistributionPlan(strategy, instance_count, ppn, mp_parameters, hyperparameters)

"""SMP v2 parameters (``tsm.init`` config; the job's ``modelparallel`` parameters when it is
paired with ``torch_distributed``): the schema as data, and its validator.

The table follows AWS's SMP v2 reference (the "core feature configuration parameters") and the
rules of AWS's notebooks: ``hybrid_shard_degree`` from 0 to world / ``tensor_parallel_degree``,
``context_parallel_degree`` at most the hybrid shard degree. Where dtrain needs more than AWS
says, it says why in the error:

* the degrees must tile the world (:mod:`dtrain.smpv2.layout` lays the ranks out as a grid):
  ``tensor_parallel_degree`` divides the world, ``hybrid_shard_degree`` divides world / tp, and
  ``context_parallel_degree`` divides the hybrid shard degree;
* ``expert_parallel_degree`` is 1: expert parallelism is not available yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dtrain.config.modelparallel import MP_PARAMETER_ALIASES, MP_PARAMETER_NAMES
from dtrain.config.schema import (
    ParameterSpec,
    coerce,
    table_markdown,
    warn_without_effect,
    with_defaults,
)
from dtrain.errors import ConfigError, UnknownKeyError

PARAMETERS: tuple[ParameterSpec, ...] = (
    ParameterSpec(
        "hybrid_shard_degree",
        int,
        0,
        "Ranks each parameter is sharded over (one FSDP shard group, made of whole "
        "context-parallel groups); the shard groups replicate one another (hybrid sharding). "
        "0: world / tensor_parallel_degree with tensor or context parallelism, else the "
        "script's FSDP as torch has it; 1: no sharding.",
        minimum=0,
    ),
    ParameterSpec(
        "sm_activation_offloading",
        bool,
        True,
        "Offload checkpointed activations to host memory; scripts read it from tsm.state and "
        "wrap the model in torch's offload_wrapper.",
    ),
    ParameterSpec(
        "activation_loading_horizon",
        int,
        2,
        "Most offloaded or checkpointed layers whose inputs are in device memory at once.",
        minimum=1,
        without_effect="torch's offload_wrapper copies each offloaded activation back when the "
        "backward pass reaches it",
    ),
    ParameterSpec(
        "fsdp_cache_flush_warnings",
        bool,
        True,
        "Warn when the CUDA caching allocator flushes its cache, which slows training.",
        without_effect="dtrain does not watch the allocator's cache flushes",
    ),
    ParameterSpec(
        "allow_empty_shards",
        bool,
        False,
        "Allow empty shards of tensors that do not divide evenly (SMP's fix for a crash in "
        "checkpointing); false keeps PyTorch's behaviour.",
        without_effect="sharding is torch's FSDP's, which pads uneven shards",
    ),
    ParameterSpec(
        "tensor_parallel_degree",
        int,
        1,
        "Neighbouring ranks each transformed layer's weights are split over (tsm.transform).",
        minimum=1,
    ),
    ParameterSpec(
        "context_parallel_degree",
        int,
        1,
        "Ranks each sequence is split over (tsm.transform); divides the hybrid shard degree.",
        minimum=1,
    ),
    ParameterSpec(
        "expert_parallel_degree",
        int,
        1,
        "Ranks the experts of a mixture-of-experts layer are split over (tsm.transform).",
        minimum=1,
        maximum=1,
        limitation="expert parallelism is not available yet in dtrain",
    ),
    ParameterSpec(
        "random_seed",
        int,
        12345,
        "Seed of the random operations in tensor-parallel modules; each tensor-parallel rank "
        "adds its rank to it (tsm.state.get_rng_state_tracker()).",
        minimum=0,
    ),
)

SPECS: dict[str, ParameterSpec] = {spec.name: spec for spec in PARAMETERS}
SMP_V2_PARAMETER_NAMES: tuple[str, ...] = tuple(SPECS)
V1_ONLY_NAMES: tuple[str, ...] = tuple(
    sorted({*MP_PARAMETER_NAMES, *MP_PARAMETER_ALIASES} - set(SMP_V2_PARAMETER_NAMES))
)
"""SMP v1's parameters that SMP v2 does not have (``partitions``, ``microbatches``, ``ddp``...)."""
V2_ONLY_NAMES: tuple[str, ...] = tuple(
    name for name in SMP_V2_PARAMETER_NAMES if name not in MP_PARAMETER_NAMES
)
"""SMP v2's parameters that SMP v1 does not have (``hybrid_shard_degree``...)."""

V1_PAIRING = '"mpi": {"enabled": true} (not torch_distributed)'
V2_PAIRING = '"torch_distributed": {"enabled": true} (not mpi)'


def _given_values(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The user's parameters, each checked on its own; an SMP v1 parameter is named as such."""
    if not isinstance(params, Mapping):
        raise ConfigError(where, params, "a dict of SMP v2 parameters")
    for key in params:
        if key in V1_ONLY_NAMES:
            raise ConfigError(
                f"{where}.{key}",
                params[key],
                f"an SMP v2 parameter ({', '.join(SMP_V2_PARAMETER_NAMES)}); {key} is SMP v1's, "
                f"whose jobs pair modelparallel with {V1_PAIRING}",
            )
        if key not in SPECS:
            raise UnknownKeyError(where, str(key), SMP_V2_PARAMETER_NAMES)
    return {key: coerce(SPECS[key], value, f"{where}.{key}") for key, value in params.items()}


def validate_smp_v2_parameters(
    params: Mapping[str, Any], *, world_size: int | None = None, where: str = "parameters"
) -> dict[str, Any]:
    """Every SMP v2 parameter, checked and with defaults filled, in schema order.

    Errors name the dotted key under ``where``, the bad value and what is allowed. With
    ``world_size``, also checks that the degrees tile that many processes.
    """
    values = with_defaults(PARAMETERS, _given_values(params, where))
    warn_without_effect(PARAMETERS, values, where)
    if world_size is not None:
        check_world_size(values, world_size, where)
    return values


def hybrid_shard_extent(values: Mapping[str, Any], world_size: int) -> int:
    """The ranks a parameter is sharded over: ``hybrid_shard_degree``, or for 0 every rank of a
    tensor slice (world / tp), which is also what torch's FSDP shards over when the script's
    FSDP runs as torch has it (hybrid shard degree 0 without tensor or context parallelism)."""
    degree = int(values["hybrid_shard_degree"])
    return degree or world_size // int(values["tensor_parallel_degree"])


def runs_native_fsdp(values: Mapping[str, Any]) -> bool:
    """Whether the script's FSDP runs as torch has it (SMP: ``hybrid_shard_degree`` 0 with
    tensor parallel degree 1; here context parallel degree 1 too, as context parallelism
    shards over SMP's groups)."""
    return (
        values["hybrid_shard_degree"] == 0
        and values["tensor_parallel_degree"] == 1
        and values["context_parallel_degree"] == 1
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_world_size(values: Mapping[str, Any], world_size: int, where: str) -> None:
    """The degrees tile ``world_size`` ranks: tp divides the world, the hybrid shard degree
    divides world / tp (the replicas of one tensor slice) and cp divides the hybrid shard
    degree (a context-parallel group shards one set of parameters)."""
    world = f"the world size {world_size} (instance_count x processes_per_host)"
    tp = int(values["tensor_parallel_degree"])
    if world_size % tp:
        raise ConfigError(
            f"{where}.tensor_parallel_degree", tp, f"a divisor of {world}: {_divisors(world_size)}"
        )
    slice_ranks = world_size // tp
    hybrid = int(values["hybrid_shard_degree"])
    if hybrid > slice_ranks or (hybrid and slice_ranks % hybrid):
        raise ConfigError(
            f"{where}.hybrid_shard_degree",
            hybrid,
            f"0 or a divisor of world / tensor_parallel_degree = {world_size} / {tp} = "
            f"{slice_ranks}: one of {[0, *_divisors(slice_ranks)]}",
        )
    cp = int(values["context_parallel_degree"])
    extent = hybrid_shard_extent(values, world_size)
    if extent % cp:
        named = f"hybrid_shard_degree {hybrid}" if hybrid else f"world / tp = {extent}"
        raise ConfigError(
            f"{where}.context_parallel_degree",
            cp,
            f"at most the hybrid shard degree and a divisor of it ({named}): one of "
            f"{_divisors(extent)}",
        )


def schema_markdown() -> str:
    """The parameter table for the docs, generated so it cannot drift from the validator."""
    return table_markdown(PARAMETERS)

"""SMP v1 model-parallel parameters (``smp.init`` config): the schema as data, and its validator.

The table follows the documented parameters of ``smdistributed.modelparallel`` v1. Where AWS's docs
and the library disagree, dtrain follows the library's behaviour and says so in the ``help`` text:

* ``optimize`` defaults to ``"speed"`` (the library's default; the docs say ``"memory"``).
* ``pipeline_parallel_degree`` defaults to 1 (the library's default; the docs call it required).
* ``memory_weight`` defaults to 0.2 when optimizing for speed and 0.8 for memory (the documented
  rule; the library's table has a flat 0.8).
* ``active_microbatches`` defaults to ``pipeline_parallel_degree + 2`` clamped to ``microbatches``,
  since more microbatches than exist can never be in flight; a value given larger than
  ``microbatches`` is an error rather than silently clamped.
* ``fp16_params`` is the deprecated spelling of ``fp16``: when true, ``fp16`` comes back true too.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from dtrain.config.schema import (
    Derived,
    ParameterSpec,
    check_requires,
    coerce,
    table_markdown,
    warn_without_effect,
    with_defaults,
    without_effect_table,
)
from dtrain.errors import ConfigError, UnknownKeyError

PLACEMENT_PERMUTATIONS = ("DPT", "DTP", "PDT", "PTD", "TDP", "TPD")

PARAMETERS: tuple[ParameterSpec, ...] = (
    ParameterSpec(
        "pipeline_parallel_degree", int, 1, "Pipeline stages the model is split into.", minimum=1
    ),
    ParameterSpec(
        "microbatches",
        int,
        1,
        "Microbatches each batch is split into.",
        minimum=1,
        maximum=4096,
        limitation="each microbatch is a task on every pipeline rank",
    ),
    ParameterSpec(
        "pipeline",
        str,
        "interleaved",
        "Schedule: simple runs all forwards then all backwards; interleaved favours backwards.",
        choices=("simple", "interleaved", "_only_forward"),
    ),
    ParameterSpec(
        "placement_strategy",
        str,
        "cluster",
        "Rank layout; cluster = DPT, spread = TPD (right-most letter varies fastest).",
        choices=("cluster", "spread", *PLACEMENT_PERMUTATIONS),
    ),
    ParameterSpec(
        "optimize",
        str,
        "speed",
        "Tensor-parallel trade-off (library default speed; AWS docs say memory).",
        choices=("speed", "memory"),
    ),
    ParameterSpec("auto_partition", bool, True, "Partition the model automatically."),
    ParameterSpec(
        "default_partition",
        int,
        None,
        "Partition for modules outside smp.partition; required when auto_partition is false.",
        minimum=0,
        nullable=True,
    ),
    ParameterSpec(
        "contiguous",
        bool,
        True,
        "Partitions form connected subgraphs (TensorFlow).",
        without_effect="dtrain's planner cuts the modules, in the order they run, into one "
        "contiguous segment per partition (modules placed with smp.partition stay there)",
    ),
    ParameterSpec(
        "horovod",
        bool,
        False,
        "Hybrid data parallelism via Horovod (TensorFlow).",
        without_effect="dtrain has no Horovod; data parallelism comes with ddp: true",
    ),
    ParameterSpec(
        "ddp",
        bool,
        False,
        "Hybrid data parallelism via torch DDP; needed for data-parallel degree > 1 and TP.",
        requires=(("horovod", False),),
    ),
    ParameterSpec(
        "ddp_port",
        int,
        None,
        "Port of the DDP rendezvous.",
        minimum=0,
        maximum=65535,
        requires=(("ddp", True),),
        nullable=True,
        without_effect="the data-parallel groups are made in the job's process group "
        "(MASTER_ADDR, MASTER_PORT), with no rendezvous of their own",
    ),
    ParameterSpec(
        "ddp_dist_backend",
        str,
        "auto",
        "torch.distributed backend for DDP.",
        choices=("auto", "nccl"),
        requires=(("ddp", True),),
        without_effect="the data-parallel groups use the world's backend (nccl with a GPU per "
        "process, gloo otherwise)",
    ),
    ParameterSpec(
        "memory_weight",
        float,
        Derived(
            "0.2 if optimize is speed, else 0.8", lambda p: 0.2 if p["optimize"] == "speed" else 0.8
        ),
        "Weight of memory balance against compute balance in auto-partitioning.",
        minimum=0.0,
        maximum=1.0,
    ),
    ParameterSpec(
        "active_microbatches",
        int,
        Derived(
            "pipeline_parallel_degree + 2, at most microbatches",
            lambda p: min(p["pipeline_parallel_degree"] + 2, p["microbatches"]),
        ),
        "Microbatches in flight at once (at most microbatches).",
        minimum=1,
    ),
    ParameterSpec(
        "deterministic_server",
        bool,
        False,
        "The same execution order on all DP ranks: each rank computes in the order of the "
        "pipeline's plan (model.pipeline_schedule()) instead of as work becomes ready; for "
        "models whose microbatches go through the partitions in order.",
    ),
    ParameterSpec(
        "tensor_parallel_degree",
        int,
        1,
        "Tensor-parallel degree: smp.nn modules and modules marked for tensor parallelism are "
        "split over this many neighbouring ranks (DTensor).",
        minimum=1,
        requires=(("ddp", True),),
    ),
    ParameterSpec("fp16", bool, False, "Train in float16 (FP16_Module / FP16_Optimizer)."),
    ParameterSpec(
        "bf16",
        bool,
        False,
        "Train in bfloat16.",
        requires=(("fp16", False), ("fp16_params", False)),
    ),
    ParameterSpec("fp16_params", bool, False, "Deprecated spelling of fp16."),
    ParameterSpec(
        "shard_optimizer_state",
        bool,
        False,
        "Shard optimizer state across data-parallel ranks (formed by ddp).",
        requires=(("ddp", True),),
    ),
    ParameterSpec(
        "prescaled_batch",
        bool,
        False,
        "TP ranks share a batch; shard data by rdp_rank instead of dp_rank.",
        requires=(("optimize", "speed"),),
    ),
    ParameterSpec(
        "offload_activations", bool, False, "Checkpointed inputs to host memory (GPUs only)."
    ),
    ParameterSpec(
        "activation_loading_horizon",
        int,
        4,
        "How many modules ahead offloaded activations are loaded back.",
        minimum=0,
        without_effect="offloaded inputs are copied back when their recomputation starts",
    ),
    ParameterSpec(
        "skip_tracing",
        bool,
        False,
        "Skip the tracing step before partitioning.",
        without_effect="dtrain runs the model to profile it only where it partitions "
        "automatically (auto_partition: true), which needs the profile",
    ),
    ParameterSpec(
        "delayed_parameter_initialization", bool, False, "Create parameters only once partitioned."
    ),
    ParameterSpec(
        "tensor_parallel_seed", int, 0, "Seed for tensor-parallel initialization.", minimum=0
    ),
    ParameterSpec(
        "sharded_data_parallel_degree",
        int,
        1,
        "Sharded data parallelism (FSDP2): parameters, gradients and optimizer state sharded "
        "over groups of this many data-parallel ranks (with tensor parallelism: replicas of one "
        "tp slice), replicated across groups; must divide the rdp degree.",
        minimum=1,
        requires=(
            ("pipeline_parallel_degree", 1),
            ("shard_optimizer_state", False),
        ),
    ),
    ParameterSpec(
        "sdp_reduce_bucket_size",
        int,
        500_000_000,
        "Gradient bucket size (elements).",
        minimum=1,
        without_effect="FSDP2 reduce-scatters each unit's gradients in one collective, so the "
        "units are the buckets",
    ),
    ParameterSpec(
        "sdp_param_persistence_threshold",
        int,
        1_000_000,
        "SMP: parameters smaller than this are not sharded. dtrain: a submodule holding at "
        "least this many parameters (outside smaller units) is gathered on its own (an FSDP2 "
        "unit); smaller ones are sharded too and gathered with their parent.",
        minimum=0,
    ),
    ParameterSpec(
        "sdp_max_live_parameters",
        int,
        1_000_000_000,
        "Most parameters held recombined at once.",
        minimum=1,
        without_effect="FSDP2 holds the running unit's parameters gathered (and, on GPUs, the "
        "next unit's, prefetched), never more",
    ),
    ParameterSpec(
        "sdp_hierarchical_allgather",
        bool,
        True,
        "AllGather within hosts, then across.",
        without_effect="the all-gather runs within a shard group, which is neighbouring ranks, "
        "so within one host when the group fits in it",
    ),
    ParameterSpec(
        "sdp_gradient_clipping",
        float,
        1.0,
        "With sharded data parallelism, the optimizer step first clips the global L2 norm of "
        "the gradients (over all shards) to this; 0 turns clipping off.",
        minimum=0.0,
    ),
)

SPECS: dict[str, ParameterSpec] = {spec.name: spec for spec in PARAMETERS}
MP_PARAMETER_NAMES: tuple[str, ...] = tuple(SPECS)
MP_PARAMETER_ALIASES: dict[str, str] = {"partitions": "pipeline_parallel_degree"}
SMP_INTERNAL_PARAMETERS: tuple[str, ...] = (
    "fast_mode", "static_mode", "_shard_offloaded_activations",
    "task_level_activation_loading_horizon", "herring", "_match_weights",
    "_fp32_grad_accumulation", "checkpoint_attentions", "load_partition", "partition_file",
    "_sharded_data_parallelism_config",
)  # fmt: skip
"""SMP's own internal parameters (``internal: True`` in its schema), which AWS's scripts pass:
accepted and ignored, with a warning, since they tune SMP's implementation, not dtrain's."""


def _given_values(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The user's parameters, each checked on its own, with ``partitions`` folded into its name."""
    if not isinstance(params, Mapping):
        raise ConfigError(where, params, "a dict of model-parallel parameters")
    known = (*MP_PARAMETER_NAMES, *MP_PARAMETER_ALIASES)
    for key in params:
        if key in SMP_INTERNAL_PARAMETERS:
            warnings.warn(
                f"{where}.{key} is one of SMP's internal parameters: accepted and ignored",
                stacklevel=4,
            )
        elif key not in known:
            raise UnknownKeyError(where, str(key), known)
    given = {
        key: coerce(SPECS[MP_PARAMETER_ALIASES.get(key, key)], value, f"{where}.{key}")
        for key, value in params.items()
        if key not in SMP_INTERNAL_PARAMETERS
    }
    for alias, name in MP_PARAMETER_ALIASES.items():
        if alias not in given:
            continue
        value = given.pop(alias)
        if name in given and given[name] != value:
            raise ConfigError(
                f"{where}.{alias}",
                value,
                f"the same value as {name} ({given[name]}): {alias} is its alias, give only one",
            )
        given[name] = value
    return given


def _check_partitioning(values: Mapping[str, Any], where: str) -> None:
    degree = values["pipeline_parallel_degree"]
    partition = values["default_partition"]
    in_range = f"an integer from 0 to {degree - 1} (pipeline_parallel_degree is {degree})"
    if partition is None and not values["auto_partition"]:
        raise ConfigError(
            f"{where}.default_partition", None, f"{in_range}; required when auto_partition is false"
        )
    if partition is not None and partition >= degree:
        raise ConfigError(f"{where}.default_partition", partition, in_range)
    active = values["active_microbatches"]
    if active > values["microbatches"]:
        raise ConfigError(
            f"{where}.active_microbatches",
            active,
            f"an integer from 1 to microbatches ({values['microbatches']})",
        )


def check_world_size(values: Mapping[str, Any], world_size: int, where: str) -> None:
    """The model's degrees must tile the processes, extra replicas need DDP and the sharded
    data-parallel degree must divide the replicas (SMP v1 rules)."""
    pp, tp = values["pipeline_parallel_degree"], values["tensor_parallel_degree"]
    model_size = pp * tp
    if world_size % model_size:
        raise ConfigError(
            f"{where}.pipeline_parallel_degree",
            pp,
            f"pipeline_parallel_degree x tensor_parallel_degree = {pp} x {tp} = {model_size} "
            f"must divide the world size {world_size} (instance_count x processes_per_host)",
        )
    replicas = world_size // model_size
    if replicas > 1 and not values["ddp"]:
        raise ConfigError(
            f"{where}.ddp",
            False,
            f"true when the data-parallel degree is above 1: world size {world_size} / "
            f"(pipeline x tensor degree {model_size}) = {replicas} replicas; set ddp: true",
        )
    sharded = values["sharded_data_parallel_degree"]
    if replicas % sharded:
        divisors = [d for d in range(1, replicas + 1) if replicas % d == 0]
        raise ConfigError(
            f"{where}.sharded_data_parallel_degree",
            sharded,
            f"a divisor of the data-parallel degree {replicas} (world size {world_size} / "
            f"pipeline x tensor degree {model_size}): one of {divisors}",
        )


def validate_mp_parameters(
    params: Mapping[str, Any], *, world_size: int | None = None, where: str = "parameters"
) -> dict[str, Any]:
    """Every model-parallel parameter, checked and with defaults filled, in schema order.

    Errors name the dotted key under ``where``, the bad value and what is allowed. With
    ``world_size``, also checks that the parallel degrees fit that many processes.
    """
    values = with_defaults(PARAMETERS, _given_values(params, where))
    check_requires(PARAMETERS, values, where)
    _check_partitioning(values, where)
    warn_without_effect(PARAMETERS, values, where)
    if values["fp16_params"]:
        values["fp16"] = True
    if world_size is not None:
        check_world_size(values, world_size, where)
    return values


def schema_markdown() -> str:
    """The parameter table for the docs, generated so it cannot drift from the validator."""
    return table_markdown(PARAMETERS, MP_PARAMETER_ALIASES)


def without_effect_markdown() -> str:
    """The parameters dtrain accepts without effect, and what it does instead, for the docs."""
    return without_effect_table(PARAMETERS)

"""Does a partition plan fit a rank's memory, and which layout would: the check behind
``dtrain plan --memory-per-rank`` and a job's check against its GPU, in one place.

When a partition's peak (:mod:`.memory`) is over the limit, :func:`fit_layout` searches what a
user can change without touching the model: more pipeline partitions (re-planned by the
partitioner, up to ``max_partitions``, or fewer if the model has no more parts to place), more
microbatches of the same batch (smaller activations, fewer of them held under ``interleaved``),
and ``interleaved`` instead of ``simple``. It proposes the layout with the fewest partitions,
then the fewest changed settings, then the fewest microbatches: extra ranks cost hardware, a
different schedule or a finer split of the batch do not.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import MemoryLimitError
from dtrain.modelparallel.plan.memory import MemorySettings, format_size
from dtrain.modelparallel.plan.partition import PartitionPlan
from dtrain.modelparallel.plan.profile import ModelProfile
from dtrain.modelparallel.plan.solver import auto_plan
from dtrain.modelparallel.state import MPState

MAX_PARTITIONS = 8
MAX_MICROBATCHES = 64
"""How far :func:`fit_layout` looks when not told: a pipeline deeper than 8 stages or a step of
more than 64 microbatches spends most of its time filling and draining or in per-call costs."""


@dataclass
class LayoutFit:
    """What :func:`fit_layout` found: the plan of the layout it proposes, with its memory, or
    (``fits`` false) of the one that came closest."""

    plan: PartitionPlan
    fits: bool
    changes: list[str]
    """The settings changed from the starting layout, as ``"partitions 2 -> 4"``."""
    searched: str = ""
    """How far the search went, in words (``"up to 8 partitions and 64 microbatches"``)."""

    @property
    def largest(self) -> int:
        return max(peak.total for peak in self.plan.peak_memory)


def fit_layout(
    profile: ModelProfile,
    memory_per_rank: int,
    settings: MemorySettings,
    *,
    partitions: int,
    memory_weight: float,
    fixed: Mapping[str, int] | None = None,
    whole: Collection[str] = (),
    max_partitions: int = MAX_PARTITIONS,
    max_microbatches: int = MAX_MICROBATCHES,
    batch_size: int | None = None,
) -> LayoutFit:
    """The smallest change of layout (see the module's docs) whose every partition fits
    ``memory_per_rank`` bytes, starting from ``partitions`` and ``settings``.

    ``profile`` is of one microbatch of ``settings``' split; with ``batch_size`` (the step's
    samples) only microbatch counts that divide it are tried, else doublings.
    """
    base = dataclasses.replace(
        settings, profiled_microbatches=settings.profiled_microbatches or settings.microbatches
    )
    closest: LayoutFit | None = None
    variants = _variants(base, max_microbatches, batch_size)
    most = max(candidate.microbatches for candidate, _ in variants)
    searched = f"up to {max(partitions, max_partitions)} partitions and {most} microbatches"
    for count in range(partitions, max(partitions, max_partitions) + 1):
        plan = auto_plan(profile, count, memory_weight=memory_weight, fixed=fixed, whole=whole)
        if count > partitions and len(set(plan.owners.values())) < count:
            # The model has no more parts to place: more partitions would stay empty.
            searched = f"up to {count - 1} partitions (the model has no more parts to place)"
            searched += f" and {most} microbatches"
            break
        resized = [f"partitions {partitions} -> {count}"] if count != partitions else []
        for candidate, changes in variants:
            found = LayoutFit(plan.with_memory(candidate), False, resized + changes, searched)
            if found.largest <= memory_per_rank:
                found.fits = True
                return found
            if closest is None or found.largest < closest.largest:
                closest = found
            if _fixed_over(found.plan, memory_per_rank):
                break  # no schedule or split of the batch can help with this many partitions
    assert closest is not None
    closest.searched = searched
    return closest


def _fixed_over(plan: PartitionPlan, memory_per_rank: int) -> bool:
    """Whether a partition is over the limit before its activations."""
    return any(peak.total - peak.activations > memory_per_rank for peak in plan.peak_memory)


def _variants(
    settings: MemorySettings, max_microbatches: int, batch_size: int | None
) -> list[tuple[MemorySettings, list[str]]]:
    """The settings to try with one partition count, fewest changes first, then fewest
    microbatches."""
    microbatches = settings.microbatches
    top = max(microbatches, max_microbatches)
    if batch_size is None:
        counts = [microbatches << k for k in range(top.bit_length()) if microbatches << k <= top]
    else:
        counts = [m for m in range(microbatches, min(top, batch_size) + 1) if batch_size % m == 0]
    pipelines = [settings.pipeline, *(["interleaved"] if settings.pipeline == "simple" else [])]
    variants = []
    for count in counts or [microbatches]:
        for pipeline in pipelines:
            changes = []
            if count != microbatches:
                changes.append(f"microbatches {microbatches} -> {count}")
            if pipeline != settings.pipeline:
                changes.append(f"pipeline {settings.pipeline} -> {pipeline}")
            active = settings.active_microbatches
            candidate = dataclasses.replace(
                settings,
                microbatches=count,
                pipeline=pipeline,
                active_microbatches=None if active is None else min(active, count),
            )
            variants.append((len(changes), count, candidate, changes))
    variants.sort(key=lambda v: (v[0], v[1]))
    return [(candidate, changes) for _, _, candidate, changes in variants]


def check_memory(
    plan: PartitionPlan,
    profile: ModelProfile,
    memory_per_rank: int,
    *,
    memory_weight: float,
    fixed: Mapping[str, int] | None = None,
    whole: Collection[str] = (),
    limit_name: str = "allowed per rank",
    max_partitions: int = MAX_PARTITIONS,
    max_microbatches: int = MAX_MICROBATCHES,
    batch_size: int | None = None,
) -> None:
    """Raise :class:`MemoryLimitError` when a partition of ``plan`` (with its memory, see
    :meth:`PartitionPlan.with_memory`) needs more than ``memory_per_rank`` bytes, naming the
    partition, its breakdown, the limit (``limit_name`` says what it is) and a layout that
    fits, or how far the closest one is from fitting."""
    peaks = plan.peak_memory
    over = [k for k, peak in enumerate(peaks) if peak.total > memory_per_rank]
    if not over:
        return
    settings = plan.memory_settings
    assert settings is not None
    worst = max(over, key=lambda k: peaks[k].total)
    limit = f"{format_size(memory_per_rank)} {limit_name}"
    message = (
        f"partition {worst} of {plan.partitions} needs {format_size(peaks[worst].total)} at "
        f"its peak, more than the {limit}: {peaks[worst].describe()}"
    )
    others = [k for k in over if k != worst]
    if others:
        message += "; also over: " + ", ".join(
            f"partition {k} ({format_size(peaks[k].total)})" for k in others
        )
    message += f" (assuming {settings.describe(plan.partitions)})"
    fit = fit_layout(
        profile,
        memory_per_rank,
        settings,
        partitions=plan.partitions,
        memory_weight=memory_weight,
        fixed=fixed,
        whole=whole,
        max_partitions=max_partitions,
        max_microbatches=max_microbatches,
        batch_size=batch_size,
    )
    closest = fit.plan.peak_memory
    largest = max(range(fit.plan.partitions), key=lambda k: closest[k].total)
    if fit.fits:
        fitting = fit.plan.memory_settings
        assert fitting is not None
        message += (
            f". A layout that fits: {', '.join(fit.changes)} ("
            f"{fitting.describe_schedule(fit.plan.partitions)}; largest partition "
            f"{format_size(fit.largest)})"
        )
    else:
        changed = ", ".join(fit.changes) or "as planned"
        message += (
            f". No layout {fit.searched} fits: the closest ({changed}) needs "
            f"{format_size(fit.largest)} on partition {largest}, "
            f"{format_size(fit.largest - memory_per_rank)} over the limit"
        )
    raise MemoryLimitError(message)


def available_device_memory(device: torch.device, module: nn.Module) -> int:
    """Bytes the plan may use on ``device``: its free memory (after every process's use),
    what torch's allocator holds cached there, and ``module``'s own tensors already there
    (the plan counts those of its partition, and the rest are freed)."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
    own = sum(t.numel() * t.element_size() for t in tensors if t.device == device)
    return free + cached + own


def cublas_workspace_bytes(device: torch.device) -> int:
    """One cuBLAS workspace on ``device``, as torch sizes it: its own figure where it has one
    (torch 2.13), else ``CUBLAS_WORKSPACE_CONFIG``'s sizes (KiB) times counts, else its default
    (32 MiB on Hopper, ``:4096:2:16:8`` elsewhere)."""
    size = getattr(torch._C, "_cuda_getCublasWorkspaceSize", None)
    if size is not None:
        return int(size())
    pairs = re.findall(r":(\d+):(\d+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        return sum(int(kib) * int(count) for kib, count in pairs) << 10
    if torch.cuda.get_device_properties(device).major == 9:
        return 32 << 20
    return (4096 * 2 + 16 * 8) << 10


def device_limit(plan: PartitionPlan, st: MPState, module: nn.Module) -> tuple[int, str]:
    """Bytes a partition's peak may take on the rank's GPU, and the limit in words.

    The GPU's memory (:func:`available_device_memory`) is shared evenly by the ranks that
    compute on it (a host running more processes than it has GPUs), and each rank keeps a
    cuBLAS workspace for every thread that multiplies matrices (torch keeps one per thread and
    stream, allocated and never freed): the main thread and one per microbatch in flight (the
    pipeline's pooled threads), an estimate from below like the plan's figures."""
    total = torch.cuda.get_device_properties(st.device).total_memory
    sharing = -(-st.local_size // max(state.visible_gpus(), 1))
    settings = plan.memory_settings
    assert settings is not None
    threads = settings.policy(plan.partitions).active + 1
    workspaces = threads * cublas_workspace_bytes(st.device)
    limit = max(available_device_memory(st.device, module) // sharing - workspaces, 0)
    share = f" over the {sharing} ranks that share it" if sharing > 1 else ""
    name = (
        f"left on GPU {st.device} (of {format_size(total)}; its free memory{share}, less "
        f"{format_size(workspaces)} of cuBLAS workspaces for {threads} threads)"
    )
    return limit, name


def check_device_memory(
    plan: PartitionPlan,
    profile: ModelProfile,
    st: MPState,
    module: nn.Module,
    fixed: Mapping[str, int],
    whole: Collection[str],
) -> PartitionPlan:
    """A job's plan with its memory, for its config and the optimizer it registered (see
    :meth:`MemorySettings.of_job`); on a GPU, checked against the memory free on the rank's
    device before the first step (:func:`check_memory`, :func:`device_limit`). Rank 0 checks
    on its own GPU for every rank: a job's GPUs are alike."""
    settings = MemorySettings.of_job(st.config, state.current_optimizer())
    plan = plan.with_memory(settings)
    if st.device.type == "cuda":
        limit, name = device_limit(plan, st, module)
        check_memory(
            plan,
            profile,
            limit,
            memory_weight=st.config["memory_weight"],
            fixed=fixed,
            whole=whole,
            limit_name=name,
        )
    return plan

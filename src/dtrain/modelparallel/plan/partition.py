"""The partition plan: which pipeline partition owns each module, and what each partition costs.

Costs follow SMP v1: a module's **compute** is the forward and backward time of its own code
(exclusive of the modules it calls), its **memory** ``3 × parameter bytes`` (weights, gradients and
optimizer state) ``+ buffer bytes + activation bytes``, and its **cost** ``memory_weight × memory
+ (1 − memory_weight) × compute``, each part normalised to the model total (the whole model costs
one). A partition's predicted time adds the **traffic** of the runtime: a call whose caller runs
on another partition sends its tensor arguments to the owner and its outputs back (and the same
sizes again as gradients in backward), which both ranks spend time on.

Timings are noisy (a busy machine makes one layer's time jump several fold), so a plan must not
follow them where they cannot tell two plans apart. Modules built and called alike (repeated
identical layers) get one compute time, the median of theirs; and plans whose largest cost is
within :data:`TIME_TOLERANCE` of the best are taken as equally fast, the most balanced in
operations, then in memory (exact counts, free of noise), among them winning.

:func:`auto_plan` places modules from a profile:

1. **Atoms.** Walk the module tree from the root. A module is split into its children when its
   subtree costs more than one partition's share (``1 / partitions``), when a module below it is
   fixed, when a module below it shares a parameter with a module outside it (so that the tie
   holds only the modules sharing the parameter, not their whole ancestry), or when it never ran
   itself (a container such as ``nn.ModuleList``); otherwise it and its subtree are one atom. A
   module called more than once (a layer applied repeatedly, as in ALBERT) is never split unless
   a module below it is fixed: its parts would exchange every call's tensors. A split module
   keeps its own code and parameters as an atom of its own (its *glue*), and modules that never
   ran stay in their parent's atom.
2. **Constraints.** The root's glue is pinned to partition 0 (the leader runs the step body and
   the root's forward); atoms holding ``fixed`` modules are pinned where they are fixed; atoms
   holding modules that share a parameter are merged into one (the runtime keeps a parameter
   with the module owning it), placed where the first of them runs (or where one of them is
   pinned).
3. **Segments.** The free atoms, in execution order, are cut into ``partitions`` contiguous
   segments, segment ``k`` on partition ``k``, by exact dynamic programs over (partition, end of
   its segment): the first finds the least largest partition cost ``C``; among the cuts whose
   every partition costs at most ``(1 + TIME_TOLERANCE) × C``, the next finds the least largest
   partition operation count (floating-point operations of the forward, counted by torch) and
   keeps those within ``TIE_TOLERANCE`` of it; among those, the least largest partition memory;
   among those, the cuts within ``TIE_TOLERANCE`` of their least largest cost are ties, and the
   one with the least largest traffic (bytes in and out), then cost, wins.
   The programs are exact because what a partition costs, holds and moves depends only on its
   own segment: the traffic it pays is that of calls with exactly one end on it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dtrain.errors import did_you_mean
from dtrain.modelparallel.errors import PartitionError
from dtrain.modelparallel.plan.memory import (
    MemorySettings,
    StageMemory,
    format_size,
    held_microbatches,
    stage_memory,
)
from dtrain.modelparallel.plan.profile import ModelProfile, static_profile

DEFAULT_BANDWIDTH = 1e9
"""Bytes per second assumed between two partitions (a cautious figure for gloo on one host)."""

PARAMETER_COST_MULTIPLIER = 3
"""Weights, their gradients and the optimizer state: SMP's factor for parameter memory."""

TIME_TOLERANCE = 0.3
"""Plans whose largest partition cost is within this fraction of the best one's are equally good.

A module's time on a busy machine is easily 30% off. At 0.15, a tiny 4-layer GPT-2 whose root
code weighs as much as a block still had its cut moved by ±30% noise on every module in one
profile of eight (none at 0.3). Within the band the exact operation counts decide, then memory:
where memory alone decided, a plan could be up to this much slower than the fastest (an LM
whose head costs 7 blocks was cut 5 | 3 + head, 29% slower by its own profile, instead of
7 | 1 + head, for even memory)."""

TIE_TOLERANCE = 0.03
"""Among the plans equal in memory, those whose largest partition cost is within this fraction
of the best one's are ties, the one moving fewer bytes between partitions winning: moving a small
module's code off the slowest partition changes its cost by less than the noise."""

ESTIMATED_FLOP_RATE = 5e10
"""Floating-point operations per second assumed where a profile has no times: only the ratio
of compute to traffic (:data:`DEFAULT_BANDWIDTH`) depends on it, not the balance of compute."""


def estimated_time(flops: int) -> float:
    """Seconds of a module's forward and backward (about twice the forward's operations)."""
    return 3 * flops / ESTIMATED_FLOP_RATE


_PALETTE = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7", "#d9d9d9")


@dataclass
class PlacedModule:
    """One row of a plan: a module's own share (its code and parameters, not its children's)."""

    type: str
    placement: str
    """``auto`` (chosen by the planner), ``manual`` (fixed), ``inherited`` (follows its parent
    or the atom it belongs to) or ``tied`` (follows a module it shares a parameter with)."""
    param_count: int
    compute_time: float = 0.0
    """Seconds of its own forward and backward code on the profiled batch (the median over the
    modules built and called alike: repeated identical layers show one time)."""
    memory_bytes: int = 0
    cost: float = 0.0
    order: int | None = None
    """Where its first call came in the profiled forward (:attr:`ModuleStats.order`), which
    the pipeline's route follows; ``None`` if it never ran, or in a plan made without running
    the model."""


@dataclass
class StageCost:
    """What one partition does for the profiled batch (a microbatch in training), predicted."""

    compute_time: float = 0.0
    comm_time: float = 0.0
    """Seconds sending and receiving remote-call tensors, forward and backward."""
    memory_bytes: int = 0
    cost: float = 0.0
    flops: int = 0
    """Floating-point operations of the partition's forward (see :class:`ModuleStats`)."""
    param_count: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    activation_bytes: int = 0
    """Bytes of the output tensors its modules create for the profiled batch."""
    peak_memory: StageMemory | None = None
    """What it holds at its peak in training, by kind, once :meth:`PartitionPlan.with_memory`
    has been told the optimizer, precision and schedule."""

    @property
    def time(self) -> float:
        return self.compute_time + self.comm_time


@dataclass(frozen=True)
class CutStep:
    """One step of :func:`auto_plan`'s choice of a cut (see ``_CUT_CHOICE``): the least largest
    partition value of ``measure`` among the cuts still allowed, the limit it set and how many
    cuts were left within it."""

    measure: str
    """``cost``, ``flops``, ``memory`` or ``traffic``."""
    tolerance: float
    least: float
    limit: float
    cuts: int
    """Cuts allowed by this step and every step before it."""


@dataclass
class PartitionPlan:
    """Module → partition for every module of the model, with the costs behind it."""

    partitions: int
    owners: dict[str, int]
    modules: dict[str, PlacedModule]
    stages: list[StageCost]
    traffic: list[list[int]]
    """``traffic[p][q]``: bytes partition ``p`` sends partition ``q`` in one forward pass."""
    memory_weight: float = 0.0
    bandwidth: float = DEFAULT_BANDWIDTH
    profiled: bool = True
    """False for a plan made without running the model: times and costs are unknown."""
    warnings: list[str] = field(default_factory=list)
    memory_settings: MemorySettings | None = None
    """What the stages' ``peak_memory`` assumes (``None`` until :meth:`with_memory`)."""
    placeable: int = 0
    """Parts :func:`auto_plan` cut into partitions (units not pinned by a constraint)."""
    possible_cuts: int = 0
    """Cuts of those parts there were to choose from."""
    cut_choice: list[CutStep] = field(default_factory=list)
    """How :func:`auto_plan` chose the cut, step by step (empty for other plans)."""

    def owner(self, name: str) -> int:
        """Partition owning module ``name`` (``""`` is the root)."""
        try:
            return self.owners[name]
        except KeyError:
            raise PartitionError(
                f"module {name!r} is not in the partition plan (the plan was made for another "
                "model?)"
            ) from None

    @property
    def stage_costs(self) -> list[float]:
        return [stage.cost for stage in self.stages]

    @property
    def slowest_stage(self) -> int:
        """The partition with the longest predicted time."""
        return max(range(self.partitions), key=lambda k: self.stages[k].time)

    def with_memory(self, settings: MemorySettings) -> PartitionPlan:
        """This plan with every partition's peak memory under ``settings``: the microbatches
        each holds come from the schedule the runtime plans for these stage times."""
        times = [stage.compute_time for stage in self.stages] if self.profiled else []
        held = held_microbatches(settings, self.partitions, times)
        stages = [
            dataclasses.replace(
                stage,
                peak_memory=stage_memory(
                    param_count=stage.param_count,
                    param_bytes=stage.param_bytes,
                    buffer_bytes=stage.buffer_bytes,
                    activation_bytes=stage.activation_bytes,
                    held=held[k],
                    settings=settings,
                ),
            )
            for k, stage in enumerate(self.stages)
        ]
        return dataclasses.replace(self, stages=stages, memory_settings=settings)

    @property
    def peak_memory(self) -> list[StageMemory]:
        """Every partition's peak memory (see :meth:`with_memory`)."""
        peaks = [stage.peak_memory for stage in self.stages]
        if self.memory_settings is None or any(peak is None for peak in peaks):
            raise PartitionError(
                "the plan has no peak memory yet: plan.with_memory(MemorySettings(...)) "
                "says the optimizer, precision and schedule it depends on"
            )
        return peaks  # type: ignore[return-value]

    def table(self, depth: int | None = None, *, folded: bool = False) -> str:
        """Human-readable plan: one row per module, then one per partition.

        ``depth`` shows that many levels of the module tree below the root; ``folded`` ends
        each branch at the first module whose whole subtree follows it (the units the planner
        placed). A row that stands for modules below it adds theirs in and says how many
        (``+N``); its ``part`` lists every partition they are on."""
        rows = [("module", "type", "placement", "part", "params", "compute ms", "memory", "cost")]
        for name, members in self._shown_rows(depth, folded).items():
            entry = self.modules[name]
            label = "  " * (name.count(".") + 1) + name.rpartition(".")[2] if name else "(root)"
            if len(members) > 1:
                label += f" (+{len(members) - 1})"
            parts = sorted({self.owners[member] for member in members})
            entries = [self.modules[member] for member in members]
            rows.append(
                (
                    label,
                    entry.type,
                    entry.placement,
                    ",".join(map(str, parts)),
                    format_count(sum(e.param_count for e in entries)),
                    f"{sum(e.compute_time for e in entries) * 1e3:.3f}" if self.profiled else "-",
                    format_size(sum(e.memory_bytes for e in entries)),
                    f"{sum(e.cost for e in entries):.3f}" if self.profiled else "-",
                )
            )
        lines = _columns(rows, left=3)
        lines.append("")
        stage_rows = [
            ("partition", "modules", "compute ms", "comm ms", "time ms", "memory", "cost")
        ]
        for k, stage in enumerate(self.stages):
            members = sum(1 for owner in self.owners.values() if owner == k)
            known = self.profiled
            stage_rows.append(
                (
                    str(k),
                    str(members),
                    f"{stage.compute_time * 1e3:.3f}" if known else "-",
                    f"{stage.comm_time * 1e3:.3f}" if known else "-",
                    f"{stage.time * 1e3:.3f}" if known else "-",
                    format_size(stage.memory_bytes),
                    f"{stage.cost:.3f}" if known else "-",
                )
            )
        lines.extend(_columns(stage_rows, left=0))
        if self.memory_settings is not None:
            lines.append("")
            lines.extend(self._memory_table())
        if self.profiled:
            slowest = self.slowest_stage
            lines.append(
                f"slowest partition: {slowest} "
                f"({self.stages[slowest].time * 1e3:.3f} ms predicted for the profiled batch); "
                f"largest cost {max(self.stage_costs):.3f} (memory weight {self.memory_weight:g})"
            )
        for p, row in enumerate(self.traffic):
            for q, sent in enumerate(row):
                if sent:
                    lines.append(f"traffic {p} -> {q}: {format_size(sent)} per forward pass")
        why = self.why()
        if why:
            lines.append(why)
        lines.extend(f"warning: {warning}" for warning in self.warnings)
        return "\n".join(lines)

    def _shown_rows(self, depth: int | None, folded: bool) -> dict[str, list[str]]:
        """The modules :meth:`table` shows, each with the modules its row stands for (itself
        first, then the hidden modules below it)."""
        names = list(self.modules)
        shown: dict[str, list[str]] = {}
        hidden_under: str | None = None
        for index, name in enumerate(names):
            if hidden_under is not None and _within(name, hidden_under) and name != hidden_under:
                shown[hidden_under].append(name)
                continue
            hidden_under = None
            shown[name] = [name]
            below = [n for n in names[index + 1 :] if _within(n, name)] if name else names[1:]
            level = name.count(".") + 1 if name else 0
            at_depth = depth is not None and level >= depth
            follows = folded and all(
                self.modules[n].placement == "inherited" and self.owners[n] == self.owners[name]
                for n in below
            )
            if below and (at_depth or follows):
                hidden_under = name
        return shown

    def why(self) -> str | None:
        """Why :func:`auto_plan` chose this cut, from the numbers that decided it: how many cuts
        the noise band left, and which exact count then narrowed them to this one."""
        if not self.cut_choice or self.partitions == 1:
            return None
        if self.possible_cuts == 1:
            return (
                f"why this cut: {self.placeable} placeable parts go on {self.partitions} "
                "partitions only this way"
            )
        band, *rest = self.cut_choice
        parts = [f"{self.possible_cuts:,} ways to cut {self.placeable} placeable parts"]
        timed = "" if self.profiled else "; times estimated from operation counts"
        parts.append(
            f"{band.cuts:,} within the noise band (largest partition cost at most "
            f"{band.limit:.3f}: {band.tolerance:.0%} over the least, {band.least:.3f}{timed})"
        )
        left = band.cuts
        for step in rest:
            if left == 1:
                break
            if step.cuts < left:
                parts.append(f"{step.cuts:,} of them with {_describe_step(step)}")
            left = step.cuts
        if band.cuts == 1:
            verdict = "the predicted times decided"
        elif left == 1:
            verdict = "that decided"
        else:
            verdict = f"{left:,} tie on every measure: the one with the earliest cuts was taken"
        return f"why this cut: {'; '.join(parts)}; {verdict}"

    def _memory_table(self) -> list[str]:
        """One row per partition: its peak memory by kind, and what the figures assume."""
        settings = self.memory_settings
        assert settings is not None
        rows = [("peak memory", "params", "grads", "optimizer", "buffers", "activations", "total")]
        for k, peak in enumerate(self.peak_memory):
            held = peak.held_microbatches
            rows.append(
                (
                    f"partition {k}",
                    format_size(peak.params),
                    format_size(peak.grads),
                    format_size(peak.master + peak.optimizer),
                    format_size(peak.buffers),
                    f"{format_size(peak.activations)} ({held} mb)",
                    format_size(peak.total),
                )
            )
        masters = " + fp32 masters" if settings.half_precision else ""
        assumed = settings.describe(self.partitions)
        return [
            *_columns(rows, left=1),
            f"peak memory assumes {assumed};",
            f"optimizer = state{masters}; activations = module outputs x microbatches held "
            "(mb), an estimate from below",
        ]

    def to_dot(self) -> str:
        """Graphviz text: the modules placed by a decision (not ``inherited``) as a tree, filled
        with their partition's colour, and a legend with each partition's predicted time."""
        shown = [name for name, entry in self.modules.items() if entry.placement != "inherited"]
        ids = {name: f"m{i}" for i, name in enumerate(shown)}
        lines = [
            "digraph partition_plan {",
            "  rankdir=LR;",
            '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
        ]
        for k, stage in enumerate(self.stages):
            timing = f"\\n{stage.time * 1e3:.3f} ms, cost {stage.cost:.3f}" if self.profiled else ""
            if stage.peak_memory is not None:
                timing += f"\\npeak memory {format_size(stage.peak_memory.total)}"
            lines.append(
                f'  p{k} [label="partition {k}{timing}", fillcolor="{partition_colour(k)}"];'
            )
        for name in shown:
            entry = self.modules[name]
            parts = (name or "(root)", entry.type, entry.placement)
            label = "\\n".join(_dot_escape(part) for part in parts)
            colour = partition_colour(self.owners[name])
            lines.append(f'  {ids[name]} [label="{label}", fillcolor="{colour}"];')
        for name in shown:
            ancestor = name
            while ancestor:
                ancestor = ancestor.rpartition(".")[0]
                if ancestor in ids:
                    lines.append(f"  {ids[ancestor]} -> {ids[name]};")
                    break
        lines.append("}")
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartitionPlan:
        data = dict(data)
        modules = {name: PlacedModule(**row) for name, row in data.pop("modules").items()}
        stages = []
        for row in data.pop("stages"):
            row = dict(row)
            peak = row.pop("peak_memory", None)
            stages.append(
                StageCost(**row, peak_memory=None if peak is None else StageMemory(**peak))
            )
        settings = data.pop("memory_settings", None)
        return cls(
            modules=modules,
            stages=stages,
            memory_settings=None if settings is None else MemorySettings(**settings),
            cut_choice=[CutStep(**row) for row in data.pop("cut_choice", [])],
            **data,
        )


def _ranges(numbers: list[int]) -> str:
    """``partition 3`` or ``partitions 2, 5-9``: sorted numbers, consecutive ones as a range."""
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"partition {text} is" if len(numbers) == 1 else f"partitions {text} are"


def auto_plan(
    profile: ModelProfile,
    partitions: int,
    *,
    memory_weight: float,
    fixed: Mapping[str, int] | None = None,
    whole: Collection[str] = (),
    bandwidth: float = DEFAULT_BANDWIDTH,
) -> PartitionPlan:
    """Place every module so that the costliest partition costs as little as possible; the
    modules named in ``whole`` (checkpointed as one region) are never split unless a module
    below them is fixed."""
    fixed = dict(fixed or {})
    _check_weights(memory_weight, bandwidth)
    _check_placements(profile, partitions, fixed)
    if fixed.get("", 0) != 0:
        raise PartitionError(
            f"the root module is fixed to partition {fixed['']}, but automatic partitioning "
            "keeps it on partition 0, where the step runs"
        )
    model = _CostModel(profile, memory_weight, bandwidth)
    atoms = _Atoms(profile, model, partitions, fixed, set(whole))
    free = sorted((u for u in atoms.units if u.pin is None), key=lambda u: u.position)
    owners = {name: u.pin for u in atoms.units if u.pin is not None for name in u.members}
    segments, possible, choice = _best_segments(free, atoms, model, partitions)
    for k, segment in enumerate(segments):
        for unit in segment:
            owners.update(dict.fromkeys(unit.members, k))
    empty = [k for k in range(partitions) if k not in owners.values()]
    warnings = (
        [
            f"{_ranges(empty)} empty: the model splits into only {len(free)} placeable parts "
            f"besides the root's own code, fewer than the {partitions} partitions"
        ]
        if empty
        else []
    )
    plan = costed_plan(
        profile,
        partitions,
        owners,
        memory_weight=memory_weight,
        bandwidth=bandwidth,
        placements=atoms.labels,
        warnings=warnings,
    )
    return dataclasses.replace(plan, placeable=len(free), possible_cuts=possible, cut_choice=choice)


def manual_plan(
    module: nn.Module, partitions: int, *, fixed: Mapping[str, int], default_partition: int
) -> PartitionPlan:
    """SMP's ``auto_partition=False``: the root on ``fixed.get("", default_partition)``, every
    other module where it is fixed, else with its parent. Costs are not known (no profile)."""
    profile = static_profile(module)
    fixed = dict(fixed)
    _check_placements(profile, partitions, fixed)
    if not 0 <= default_partition < partitions:
        raise PartitionError(
            f"default_partition is {default_partition}, but there are {partitions} partitions: "
            f"allowed 0..{partitions - 1}"
        )
    owners: dict[str, int] = {}
    for name, stats in profile.modules.items():  # parents come before their children
        inherited = default_partition if stats.parent is None else owners[stats.parent]
        owners[name] = fixed.get(name, inherited)
    for group in profile.tied_groups:
        first = group[0]
        for other in group[1:]:
            if owners[other] != owners[first]:
                raise PartitionError(
                    f"modules {first!r} (partition {owners[first]}) and {other!r} (partition "
                    f"{owners[other]}) share a parameter, so they must be on the same partition"
                )
    placements = {name: "manual" if name in fixed or not name else "inherited" for name in owners}
    return costed_plan(
        profile, partitions, owners, memory_weight=1.0, placements=placements, profiled=False
    )


def costed_plan(
    profile: ModelProfile,
    partitions: int,
    owners: Mapping[str, int],
    *,
    memory_weight: float,
    bandwidth: float = DEFAULT_BANDWIDTH,
    placements: Mapping[str, str] | None = None,
    warnings: list[str] | None = None,
    profiled: bool = True,
) -> PartitionPlan:
    """The plan for given owners (every module named), with its predicted costs: compare any
    placement, a manual or an equal-layer one, with :func:`auto_plan`'s."""
    _check_weights(memory_weight, bandwidth)
    _check_placements(profile, partitions, owners)
    missing = [name for name in profile.modules if name not in owners]
    if missing:
        raise PartitionError(f"the plan gives no partition to modules {missing[:5]}")
    model = _CostModel(profile, memory_weight, bandwidth)
    stages = [StageCost() for _ in range(partitions)]
    modules: dict[str, PlacedModule] = {}
    for name, stats in profile.modules.items():
        time, memory = model.time[name], model.memory[name]
        stage = stages[owners[name]]
        stage.compute_time += time
        stage.memory_bytes += memory
        stage.flops += stats.flops
        stage.param_count += stats.param_count
        stage.param_bytes += stats.param_bytes
        stage.buffer_bytes += stats.buffer_bytes
        stage.activation_bytes += stats.activation_bytes
        modules[name] = PlacedModule(
            type=stats.type,
            placement=(placements or {}).get(name, "manual"),
            param_count=stats.param_count,
            compute_time=time,
            memory_bytes=memory,
            cost=model.cost(time, memory),
            order=stats.order if profiled else None,
        )
    traffic = [[0] * partitions for _ in range(partitions)]
    for caller, callee, sent, returned in model.calls:
        p, q = owners[caller], owners[callee]
        if p != q:
            traffic[p][q] += sent
            traffic[q][p] += returned
            stages[p].comm_time += model.comm_time(sent + returned)
            stages[q].comm_time += model.comm_time(sent + returned)
    for stage in stages:
        stage.cost = model.cost(stage.time, stage.memory_bytes)
    return PartitionPlan(
        partitions=partitions,
        owners={name: owners[name] for name in profile.modules},
        modules=modules,
        stages=stages,
        traffic=traffic,
        memory_weight=memory_weight,
        bandwidth=bandwidth,
        profiled=profiled,
        warnings=list(warnings or []),
    )


# --------------------------------------------------------------------------------------------
# Checks


def _check_weights(memory_weight: float, bandwidth: float) -> None:
    if not 0.0 <= memory_weight <= 1.0:
        raise PartitionError(f"memory_weight is {memory_weight}; allowed: 0 to 1")
    if bandwidth <= 0:
        raise PartitionError(f"bandwidth is {bandwidth} bytes/s; it must be positive")


def _check_placements(profile: ModelProfile, partitions: int, placed: Mapping[str, int]) -> None:
    """``partitions`` is at least 1 and every placed module exists and has a partition in range."""
    if partitions < 1:
        raise PartitionError(f"partitions is {partitions}; it must be at least 1")
    for name, partition in placed.items():
        if name not in profile.modules:
            guess = did_you_mean(name, profile.modules)
            hint = f" (did you mean {guess!r}?)" if guess else ""
            raise PartitionError(f"there is no module {name!r} in the model to place{hint}")
        if not isinstance(partition, int) or not 0 <= partition < partitions:
            raise PartitionError(
                f"module {name!r} is placed on partition {partition!r}, but there are "
                f"{partitions} partitions: allowed 0..{partitions - 1}"
            )


# --------------------------------------------------------------------------------------------
# Costs


class _CostModel:
    """Per-module time and memory, the traffic of every call, and the normalised cost."""

    def __init__(self, profile: ModelProfile, memory_weight: float, bandwidth: float) -> None:
        self.memory_weight = memory_weight
        self.time = _pooled_times(profile)
        self.memory = {
            name: PARAMETER_COST_MULTIPLIER * m.param_bytes + m.buffer_bytes + m.activation_bytes
            for name, m in profile.modules.items()
        }
        self.total_time = sum(self.time.values())
        self.total_memory = sum(self.memory.values())
        # Gradients of the outputs go to the owner in backward, those of the inputs come back.
        self.seconds_per_byte = (2 if profile.backward_measured else 1) / bandwidth
        self.calls = [
            (profile.calls[call.caller].module, call.module, call.input_bytes, call.output_bytes)
            for call in profile.calls
            if call.caller >= 0
        ]

    def comm_time(self, moved: int) -> float:
        return moved * self.seconds_per_byte

    def cost(self, time: float, memory: float) -> float:
        w = self.memory_weight
        memory_share = memory / self.total_memory if self.total_memory else 0.0
        time_share = time / self.total_time if self.total_time else 0.0
        return w * memory_share + (1 - w) * time_share


def _pooled_times(profile: ModelProfile) -> dict[str, float]:
    """Each module's own forward and backward time, as the median over the modules alike: layers
    doing the same work cost the same, so noise cannot favour one cut between them over another.
    A profile without times (a model planned from the meta device) has them estimated from its
    exact operation counts."""
    if not _timed(profile):
        return {name: estimated_time(m.flops) for name, m in profile.modules.items()}
    kinds = _kinds(profile)
    alike: dict[Hashable, list[float]] = {}
    for name, m in profile.modules.items():
        alike.setdefault(kinds[name], []).append(m.forward_exclusive + m.backward_exclusive)
    median = {kind: statistics.median(times) for kind, times in alike.items()}
    return {name: median[kinds[name]] for name in profile.modules}


def _timed(profile: ModelProfile) -> bool:
    return any(m.forward_exclusive or m.backward_exclusive for m in profile.modules.values())


def _kinds(profile: ModelProfile) -> dict[str, Hashable]:
    """A key per module, equal for modules built and called alike: type, own parameters and
    buffers, calls with their tensor sizes, activation bytes, and the same of every module below."""
    sizes: dict[str, list[tuple[int, int]]] = {}
    for call in profile.calls:
        sizes.setdefault(call.module, []).append((call.input_bytes, call.output_bytes))
    kinds: dict[str, Hashable] = {}
    for name, m in reversed(profile.modules.items()):  # children before their parents
        below = tuple((child[len(name) :], kinds[child]) for child in m.children)
        kinds[name] = (
            m.type,
            m.param_bytes,
            m.buffer_bytes,
            m.activation_bytes,
            tuple(sizes.get(name, ())),
            below,
        )
    return kinds


@dataclass
class _Unit:
    """Modules that go to one partition together; ``pin`` is their partition once known."""

    members: list[str]
    position: int
    pin: int | None
    time: float = 0.0
    memory: int = 0
    flops: int = 0


class _Atoms:
    """Steps 1 and 2 of :func:`auto_plan`: the units (atoms, tied ones merged), pinned or free,
    and how each module got its place."""

    def __init__(
        self,
        profile: ModelProfile,
        model: _CostModel,
        partitions: int,
        fixed: dict[str, int],
        whole: set[str],
    ) -> None:
        self.profile = profile
        self.fixed = fixed
        self.whole = whole
        self.cost = {name: model.cost(model.time[name], model.memory[name]) for name in model.time}
        self.share = sum(self.cost.values()) / partitions
        self.units: list[_Unit] = []
        self.unit_of: dict[str, _Unit] = {}
        self.labels: dict[str, str] = {}
        self._subtree_cost: dict[str, float] = {}
        self._ran_below: dict[str, bool] = {}
        self._fixed_below: dict[str, bool] = {}
        self._tied_out = _tied_outwards(profile)
        self._summarise("")
        self._place("", None)
        self._tie()
        for unit in self.units:
            unit.time = sum(model.time[name] for name in unit.members)
            unit.memory = sum(model.memory[name] for name in unit.members)
            unit.flops = sum(profile.modules[name].flops for name in unit.members)

    def _summarise(self, name: str) -> None:
        """Subtree cost, and whether a module below ran or is fixed (children first)."""
        cost, ran, fixed = self.cost[name], False, False
        for child in self.profile.modules[name].children:
            self._summarise(child)
            cost += self._subtree_cost[child]
            ran = ran or self.profile.modules[child].calls > 0 or self._ran_below[child]
            fixed = fixed or child in self.fixed or self._fixed_below[child]
        self._subtree_cost[name] = cost
        self._ran_below[name] = ran
        self._fixed_below[name] = fixed

    def _place(self, name: str, glue: _Unit | None) -> None:
        stats = self.profile.modules[name]
        if glue is not None and stats.calls == 0 and name not in self.fixed:
            self._join(glue, name, "inherited")
            for child in stats.children:
                self._place(child, glue)
            return
        pin = 0 if glue is None else self.fixed.get(name)
        unit = _Unit([], position=-1 if stats.order is None else stats.order, pin=pin)
        self.units.append(unit)
        self._join(unit, name, "manual" if name in self.fixed else "auto")
        big = self._ran_below[name] and self._subtree_cost[name] > self.share
        split = (
            glue is None
            or stats.calls == 0
            or self._fixed_below[name]
            or (stats.calls == 1 and name not in self.whole and (big or name in self._tied_out))
        )
        for child in stats.children:
            if split:
                self._place(child, unit)
            else:
                self._join_subtree(unit, child)

    def _join(self, unit: _Unit, name: str, label: str) -> None:
        unit.members.append(name)
        self.unit_of[name] = unit
        self.labels[name] = label

    def _join_subtree(self, unit: _Unit, name: str) -> None:
        self._join(unit, name, "inherited")
        for child in self.profile.modules[name].children:
            self._join_subtree(unit, child)

    def _tie(self) -> None:
        """Merge the units of modules sharing a parameter into the pinned or the first one."""
        for group in self.profile.tied_groups:
            pins = [(self.unit_of[n].pin, n) for n in group if self.unit_of[n].pin is not None]
            for pin, name in pins[1:]:
                if pin != pins[0][0]:
                    raise PartitionError(
                        f"modules {pins[0][1]!r} (partition {pins[0][0]}) and {name!r} "
                        f"(partition {pin}) share a parameter, so they must be on one partition"
                    )
            units = list({id(self.unit_of[n]): self.unit_of[n] for n in group}.values())
            pinned = [unit for unit in units if unit.pin is not None]
            target = pinned[0] if pinned else min(units, key=lambda unit: unit.position)
            for unit in units:
                if unit is target:
                    continue
                if self.labels[unit.members[0]] == "auto":
                    self.labels[unit.members[0]] = "tied"
                for name in unit.members:
                    target.members.append(name)
                    self.unit_of[name] = target
                self.units.remove(unit)


def _tied_outwards(profile: ModelProfile) -> set[str]:
    """Modules with a module below them that shares a parameter with a module outside them."""
    found: set[str] = set()
    for group in profile.tied_groups:
        for member in group:
            ancestor = profile.modules[member].parent
            while ancestor is not None:
                if not all(_within(other, ancestor) for other in group):
                    found.add(ancestor)
                ancestor = profile.modules[ancestor].parent
    return found


def _within(name: str, ancestor: str) -> bool:
    """``name`` is ``ancestor`` or in its subtree."""
    return not ancestor or name == ancestor or name.startswith(ancestor + ".")


_CUT_CHOICE = (
    ("cost", TIME_TOLERANCE),
    ("flops", TIE_TOLERANCE),
    ("memory", 0.0),
    ("cost", TIE_TOLERANCE),
    ("traffic", 0.0),
    ("cost", 0.0),
)
"""How step 3 chooses a cut: each step finds the least largest partition value of its measure
among the cuts every earlier step allowed, and allows those within its tolerance of that.
Operation counts, memory and traffic are exact, so timing noise cannot move the choices they
make; operations come first, being what the time mostly follows (a model whose operations
torch does not count, all zero, is left to memory)."""


def _best_segments(
    free: list[_Unit], atoms: _Atoms, model: _CostModel, partitions: int
) -> tuple[list[list[_Unit]], int, list[CutStep]]:
    """Step 3 of :func:`auto_plan`: contiguous segments of ``free``, segment ``k`` on partition
    ``k`` (pinned units count where they are pinned), chosen by the steps of ``_CUT_CHOICE``;
    with how many cuts there were and what each step left.

    Every segment is non-empty when there are at least as many free units as partitions.
    """
    stage = _StageCosts(free, atoms, model, partitions)
    measures = {
        "cost": stage.cost,
        "flops": stage.flops,
        "memory": stage.memory,
        "traffic": stage.traffic,
    }
    n = len(free)
    gap = 1 if n >= partitions else 0  # least units per segment
    limits: list[tuple[Callable[[int, int, int], float], float]] = []

    def allowed(k: int, left: int, right: int) -> bool:
        return all(measure(k, left, right) <= limit for measure, limit in limits)

    possible = _count_cuts(n, partitions, gap, allowed)
    bounds: list[int] = []
    steps: list[CutStep] = []
    for name, tolerance in _CUT_CHOICE:
        least, bounds = _min_max_cuts(n, partitions, gap, measures[name], allowed)
        limit = least * (1 + tolerance)
        limits.append((measures[name], limit))
        # One cut left stays the only one: each later step keeps the cut it finds.
        left = 1 if steps and steps[-1].cuts == 1 else _count_cuts(n, partitions, gap, allowed)
        steps.append(CutStep(name, tolerance, least, limit, left))
    return [free[left:right] for left, right in itertools.pairwise(bounds)], possible, steps


def _count_cuts(n: int, partitions: int, gap: int, allowed: Callable[[int, int, int], bool]) -> int:
    """How many cuts :func:`_min_max_cuts` chooses among: every segment ``allowed``."""
    ways = [[0] * (n + 1) for _ in range(partitions)]
    for right in range(gap, n + 1):
        ways[0][right] = int(allowed(0, 0, right))
    for k in range(1, partitions):
        for right in range(n + 1):
            ways[k][right] = sum(
                ways[k - 1][left]
                for left in range(right - gap + 1)
                if ways[k - 1][left] and allowed(k, left, right)
            )
    return ways[-1][n]


def _min_max_cuts(
    n: int,
    partitions: int,
    gap: int,
    value: Callable[[int, int, int], float],
    allowed: Callable[[int, int, int], bool],
) -> tuple[float, list[int]]:
    """The cut of ``0..n`` into ``partitions`` segments of at least ``gap`` units, every segment
    ``allowed``, with the least largest ``value(k, left, right)``: that value and the bounds.

    Exact by dynamic programming over (partition, end of its segment), since a segment's value
    depends on nothing else; of equal cuts, the one with the earliest last bounds wins.
    """
    best = [[math.inf] * (n + 1) for _ in range(partitions)]
    start = [[0] * (n + 1) for _ in range(partitions)]
    for right in range(gap, n + 1):
        if allowed(0, 0, right):
            best[0][right] = value(0, 0, right)
    for k in range(1, partitions):
        for right in range(n + 1):
            for left in range(right - gap + 1):
                if best[k - 1][left] == math.inf or not allowed(k, left, right):
                    continue
                candidate = max(best[k - 1][left], value(k, left, right))
                if candidate < best[k][right]:
                    best[k][right] = candidate
                    start[k][right] = left
    bounds = [n]
    for k in range(partitions - 1, 0, -1):
        bounds.append(start[k][bounds[-1]])
    bounds.append(0)
    return best[-1][n], bounds[::-1]


class _StageCosts:
    """Cost and memory of partition ``k`` holding ``free[left:right]`` with its pinned units, in
    constant time from prefix sums: what the partition pays for traffic depends only on which
    units it holds (calls with exactly one end on it)."""

    def __init__(
        self, free: list[_Unit], atoms: _Atoms, model: _CostModel, partitions: int
    ) -> None:
        self.model = model
        n = len(free)
        index = {id(unit): i for i, unit in enumerate(free)}
        self.pinned_time = [0.0] * partitions
        self.pinned_memory = [0] * partitions
        self.pinned_flops = [0] * partitions
        for unit in atoms.units:
            if unit.pin is not None:
                self.pinned_time[unit.pin] += unit.time
                self.pinned_memory[unit.pin] += unit.memory
                self.pinned_flops[unit.pin] += unit.flops
        # Bytes moved by calls between units: free-free, free-pinned and pinned-pinned.
        free_degree = [0] * n
        earlier: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        pinned_degree = [[0] * n for _ in range(partitions)]
        self.pinned_total = [0] * partitions
        self.pinned_pinned = [0] * partitions
        for caller, callee, sent, returned in model.calls:
            a, b = atoms.unit_of[caller], atoms.unit_of[callee]
            moved = sent + returned
            if a is b or not moved:
                continue
            if a.pin is None and b.pin is None:
                i, j = sorted((index[id(a)], index[id(b)]))
                free_degree[i] += moved
                free_degree[j] += moved
                earlier[j].append((i, moved))
            elif a.pin is not None and b.pin is not None:
                if a.pin != b.pin:
                    self.pinned_pinned[a.pin] += moved
                    self.pinned_pinned[b.pin] += moved
            else:
                unit, pin = (a, b.pin) if b.pin is not None else (b, a.pin)
                assert pin is not None
                pinned_degree[pin][index[id(unit)]] += moved
                self.pinned_total[pin] += moved
        self.time_sum = _prefix([unit.time for unit in free])
        self.memory_sum = _prefix([unit.memory for unit in free])
        self.flops_sum = _prefix([unit.flops for unit in free])
        self.free_sum = _prefix(free_degree)
        self.pinned_sum = [_prefix(row) for row in pinned_degree]
        self.all_pinned_sum = _prefix([sum(column) for column in zip(*pinned_degree, strict=True)])
        # internal[l][r]: bytes of calls with both ends in free[l:r].
        self.internal = [[0] * (n + 1) for _ in range(n + 1)]
        for left in range(n):
            inside = 0
            for right in range(left + 1, n + 1):
                inside += sum(moved for i, moved in earlier[right - 1] if i >= left)
                self.internal[left][right] = inside
        self._costs: dict[tuple[int, int, int], float] = {}

    def memory(self, k: int, left: int, right: int) -> int:
        return self.memory_sum[right] - self.memory_sum[left] + self.pinned_memory[k]

    def flops(self, k: int, left: int, right: int) -> int:
        return self.flops_sum[right] - self.flops_sum[left] + self.pinned_flops[k]

    def cost(self, k: int, left: int, right: int) -> float:
        key = (k, left, right)
        if key not in self._costs:
            self._costs[key] = self.model.cost(self._time(k, left, right), self.memory(*key))
        return self._costs[key]

    def traffic(self, k: int, left: int, right: int) -> int:
        """Bytes of the calls with exactly one end on the partition, both ways."""
        own = self.pinned_sum[k][right] - self.pinned_sum[k][left]
        return (
            self.free_sum[right]
            - self.free_sum[left]
            - 2 * self.internal[left][right]
            + self.all_pinned_sum[right]
            - self.all_pinned_sum[left]
            - 2 * own
            + self.pinned_total[k]
            + self.pinned_pinned[k]
        )

    def _time(self, k: int, left: int, right: int) -> float:
        compute = self.time_sum[right] - self.time_sum[left] + self.pinned_time[k]
        return compute + self.model.comm_time(self.traffic(k, left, right))


# --------------------------------------------------------------------------------------------
# Formatting


def _describe_step(step: CutStep) -> str:
    """A step of the cut's choice after the noise band, in words, with its deciding number."""
    more = f", or up to {step.tolerance:.0%} more" if step.tolerance else ""
    if step.measure == "flops":
        least = format_count(int(step.least))
        return f"the most even forward operations ({least} on the largest partition{more})"
    if step.measure == "memory":
        return f"the least memory on the largest partition ({format_size(int(step.least))})"
    if step.measure == "traffic":
        least = format_size(int(step.least))
        return f"the least traffic of the busiest partition ({least} in and out)"
    if step.tolerance:
        return (
            f"a largest partition cost up to {step.tolerance:.0%} over the least ({step.least:.3f})"
        )
    return f"exactly the least largest partition cost ({step.least:.3f})"


def _prefix(values: list[Any]) -> list[Any]:
    """``sums[i]`` is the sum of ``values[:i]``."""
    return list(itertools.accumulate(values, initial=0))


def _columns(rows: list[tuple[str, ...]], left: int) -> list[str]:
    """Rows as aligned text: the first ``left`` columns flush left, the others flush right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def format_count(count: int) -> str:
    """``1.2M``: a count of parameters or operations, short."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{suffix}"
    return str(count)


def partition_colour(partition: int) -> str:
    """The colour of ``partition`` in drawings (the Graphviz text, the PNG)."""
    return _PALETTE[partition % len(_PALETTE)]


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')

"""A partition plan as text: its table (``plan.table()``), why the planner chose its cut
(``plan.why()``) and a Graphviz drawing (``plan.to_dot()``).

:class:`PlanText` is the base of :class:`~.partition.PartitionPlan` that reads its fields; the
plan's figure is drawn by :mod:`.planview`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from dtrain.modelparallel.plan.memory import MemorySettings, StageMemory, format_size
from dtrain.modelparallel.plan.profile import within
from dtrain.modelparallel.plan.rows import CutStep, PlacedModule, StageCost

_PALETTE = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7", "#d9d9d9")


class PlanText(abc.ABC):
    """How a partition plan reads (see the module docstring): what it shows of the plan's
    fields."""

    partitions: int
    owners: dict[str, int]
    modules: dict[str, PlacedModule]
    stages: list[StageCost]
    traffic: list[list[int]]
    memory_weight: float
    profiled: bool
    warnings: list[str]
    memory_settings: MemorySettings | None
    placeable: int
    possible_cuts: int
    cut_choice: list[CutStep]

    @property
    @abc.abstractmethod
    def peak_memory(self) -> list[StageMemory]:
        """Every partition's peak memory."""

    @property
    def stage_costs(self) -> list[float]:
        return [stage.cost for stage in self.stages]

    @property
    def slowest_stage(self) -> int:
        """The partition with the longest predicted time."""
        return max(range(self.partitions), key=lambda k: self.stages[k].time)

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
            placed = sum(1 for owner in self.owners.values() if owner == k)
            known = self.profiled
            stage_rows.append(
                (
                    str(k),
                    str(placed),
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
            if hidden_under is not None and within(name, hidden_under) and name != hidden_under:
                shown[hidden_under].append(name)
                continue
            hidden_under = None
            shown[name] = [name]
            below = [n for n in names[index + 1 :] if within(n, name)] if name else names[1:]
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
        """Why :func:`~.solver.auto_plan` chose this cut, from the numbers that decided it: how
        many cuts the noise band left, and which exact count then narrowed them to this one."""
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


def _columns(rows: Sequence[tuple[str, ...]], left: int) -> list[str]:
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

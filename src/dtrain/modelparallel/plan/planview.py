"""Plans people can look at: ``dtrain plan --png`` and the progress of its profiling.

The drawing is made with matplotlib's Agg canvas (no display, no Graphviz): one row per
partition, its predicted time (compute and traffic) or, for a plan made without times, its
forward operations, beside its peak memory by kind (:mod:`.memory`), with the planner's reason
for the cut underneath. Every partition is labelled alike, with every unit the planner placed
there (numbered siblings as a range: ``blocks.0–2``), and the figure grows to hold the labels,
so that no text leaves its row or the picture. :func:`figure_data` is what is drawn, kept apart
so that it can be checked without looking at pixels; :func:`plan_figure` the figure, whose
layout can be checked by its geometry.
"""

from __future__ import annotations

import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from dtrain.modelparallel.plan.memory import format_size
from dtrain.modelparallel.plan.partition import PartitionPlan
from dtrain.modelparallel.plan.render import format_count, partition_colour

MEMORY_KINDS = ("params", "grads", "optimizer", "buffers", "activations")
"""The peak-memory columns of the text plan, in its order."""

_LABEL_WIDTH = 40
"""Characters in a line of a partition's label."""
_LINE_INCHES = 0.15
"""Height of a line of 8-point text, with its spacing: the unit of the drawing's y axis."""
_ROW_LINES = 4.5
"""Least height of a partition's row, in lines; its bar is ``_BAR_LINES`` thick."""
_BAR_LINES = 3.2


@dataclass(frozen=True)
class PartitionBar:
    """What the drawing shows of one partition."""

    partition: int
    label: str
    """The modules the planner placed there (its units), numbered siblings as ranges."""
    compute_ms: float
    comm_ms: float
    flops: int
    memory: dict[str, int]
    """Peak memory by kind (:data:`MEMORY_KINDS`) once the plan knows it, else the planner's
    memory (``3 x parameters + buffers + activations``) as ``planner``."""


@dataclass(frozen=True)
class PlanFigure:
    title: str
    timed: bool
    """The plan has predicted times (else its partitions are drawn by operations)."""
    bars: list[PartitionBar]
    why: str | None


def figure_data(plan: PartitionPlan, title: str = "") -> PlanFigure:
    """The numbers :func:`draw_plan` draws, straight from the plan."""
    bars = []
    for k, stage in enumerate(plan.stages):
        placed = [
            name or "(root)"
            for name, entry in plan.modules.items()
            if plan.owners[name] == k and entry.placement != "inherited"
        ]
        peak = stage.peak_memory
        memory = (
            {"planner": stage.memory_bytes}
            if peak is None
            else dict(
                zip(
                    MEMORY_KINDS,
                    (
                        peak.params,
                        peak.grads,
                        peak.master + peak.optimizer,
                        peak.buffers,
                        peak.activations,
                    ),
                    strict=True,
                )
            )
        )
        bars.append(
            PartitionBar(
                partition=k,
                label=_members_label(placed),
                compute_ms=stage.compute_time * 1e3,
                comm_ms=stage.comm_time * 1e3,
                flops=stage.flops,
                memory=memory,
            )
        )
    heading = title or f"partition plan: {plan.partitions} partitions"
    return PlanFigure(heading, plan.profiled, bars, plan.why())


def _members_label(names: list[str]) -> str:
    return ", ".join(unit_ranges(names)) if names else "(empty)"


def unit_ranges(names: list[str]) -> list[str]:
    """``names`` in order, each run of consecutive numbered siblings as one range
    (``blocks.0``, ``blocks.1``, ``blocks.2``: ``blocks.0–2``)."""
    runs: list[tuple[str, int, int] | str] = []
    for name in names:
        parent, _, index = name.rpartition(".")
        last = runs[-1] if runs else None
        if not index.isdigit():
            runs.append(name)
        elif isinstance(last, tuple) and last[0] == parent and last[2] + 1 == int(index):
            runs[-1] = (parent, last[1], int(index))
        else:
            runs.append((parent, int(index), int(index)))
    return [
        run
        if isinstance(run, str)
        else f"{run[0] + '.' if run[0] else ''}{run[1]}{f'–{run[2]}' if run[2] > run[1] else ''}"
        for run in runs
    ]


def draw_plan(plan: PartitionPlan, path: str | Path, title: str = "") -> None:
    """Write the plan as a PNG (or any format matplotlib infers from ``path``)."""
    plan_figure(plan, title).savefig(path, dpi=100)


def plan_figure(plan: PartitionPlan, title: str = "") -> Any:
    """The plan's drawing (a matplotlib ``Figure``, laid out): 12 inches wide, and as tall as
    its partitions' labels need."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = figure_data(plan, title)
    rows = len(data.bars)
    labels = [f"partition {bar.partition}\n{_wrapped(bar.label)}" for bar in data.bars]
    heights = [max(_ROW_LINES, label.count("\n") + 2.5) for label in labels]  # in lines
    ys = [sum(heights[:k]) + heights[k] / 2 for k in range(rows)]
    figure = Figure(figsize=(12, 1.8 + _LINE_INCHES * sum(heights)), layout="constrained")
    FigureCanvasAgg(figure)  # headless: no display or pyplot global state needed
    figure.suptitle(data.title)
    work, memory = figure.subplots(1, 2, sharey=True)
    style = {"height": _BAR_LINES, "edgecolor": "black"}
    colours = [partition_colour(bar.partition) for bar in data.bars]
    if data.timed:
        compute = [bar.compute_ms for bar in data.bars]
        work.barh(ys, compute, color=colours, label="compute", **style)
        work.barh(
            ys, [bar.comm_ms for bar in data.bars], left=compute, color="#bbbbbb", hatch="//",
            label="traffic", **style,
        )  # fmt: skip
        work.set_xlabel("predicted ms per microbatch (forward + backward)")
        for y, bar in zip(ys, data.bars, strict=True):
            total = bar.compute_ms + bar.comm_ms
            work.annotate(
                f" {total:.1f} ms, {format_count(bar.flops)} ops", (total, y), va="center",
                fontsize=8,
            )  # fmt: skip
        _legend_above(work)
    else:
        flops = [bar.flops for bar in data.bars]
        work.barh(ys, flops, color=colours, **style)
        work.set_xlabel("forward operations (no times: planned from operation counts)")
        for y, value in zip(ys, flops, strict=True):
            work.annotate(f" {format_count(value)}", (value, y), va="center", fontsize=8)
    work.set_yticks(ys, labels, fontsize=8)
    work.set_ylim(sum(heights), 0)  # partition 0 on top; each row as tall as its label
    left: list[float] = [0] * rows
    kinds = list(data.bars[0].memory) if data.bars else []
    for kind, colour in zip(kinds, _MEMORY_COLOURS, strict=False):
        widths = [bar.memory[kind] / 2**20 for bar in data.bars]
        memory.barh(ys, widths, left=left, color=colour, label=kind, **style)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, bar in zip(ys, data.bars, strict=True):
        total = sum(bar.memory.values())
        memory.annotate(f" {format_size(total)}", (total / 2**20, y), va="center", fontsize=8)
    peak = "peak memory in training" if kinds != ["planner"] else "planner memory"
    memory.set_xlabel(f"{peak}, MiB")
    _legend_above(memory)
    for ax in (work, memory):
        ax.grid(True, axis="x", alpha=0.3)
    if data.why:
        figure.supxlabel(textwrap.fill(data.why, 160), fontsize=8, ha="left", x=0.01)
    figure.draw_without_rendering()  # the layout, which the annotations' room depends on
    for ax in (work, memory):
        _room_for_annotations(ax)
    figure.draw_without_rendering()
    return figure


_MEMORY_COLOURS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974")


def _legend_above(ax: Any) -> None:
    """A legend in one row over the axes, where it hides no bar or figure."""
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1), ncol=5, fontsize=8, frameon=False)


def _room_for_annotations(ax: Any) -> None:
    """Widen ``ax``'s x range so that the text after each bar ends inside the axes: a bar ending
    at ``b`` with text ``w`` pixels wide, in axes ``W`` pixels wide, needs a limit
    ``R >= b / (1 - w / W)``."""
    width = ax.get_window_extent().width
    right = max(ax.get_xlim()[1], 1e-9)
    for text in ax.texts:
        end = text.xy[0]
        share = text.get_window_extent().width / width
        right = max(right, end / (1 - share) * 1.02 if share < 0.9 else end * 10)
    ax.set_xlim(0, right)


def _wrapped(text: str) -> str:
    """``text`` in lines of :data:`_LABEL_WIDTH` characters, or of its longest name's: never
    one split."""
    width = max(_LABEL_WIDTH, *(len(name) + 1 for name in text.split(", ")))
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


class StageProgress:
    """What a long ``dtrain plan`` is doing, on one line of a terminal rewritten in place
    (a bar over the profiling passes, the seconds so far); nothing when the stream is not a
    terminal (a pipe, a log file), so that output stays clean."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.live = self.stream.isatty()
        self._start = time.monotonic()
        self._shown = False

    def stage(self, what: str) -> None:
        """A stage without passes: importing, creating the model, planning."""
        self._show(f"{what} ...")

    def passes(self, done: int, total: int, what: str) -> None:
        """Profiling: ``done`` of ``total`` passes (the callback of ``profile_module``)."""
        width = 20
        filled = width * done // max(total, 1)
        self._show(f"profiling [{'#' * filled}{'.' * (width - filled)}] {what}")

    def done(self) -> None:
        """Clear the line before the plan is printed."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    def _show(self, text: str) -> None:
        if not self.live:
            return
        elapsed = time.monotonic() - self._start
        self.stream.write(f"\r\x1b[Kdtrain plan: {text} ({elapsed:.1f} s)")
        self.stream.flush()
        self._shown = True

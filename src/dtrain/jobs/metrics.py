"""Training metrics as SageMaker collects them: regexes over the log, one time series per name."""

from __future__ import annotations

import csv
import datetime
import io
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import re2

from dtrain.errors import ConfigError, DtrainError, UnknownKeyError

_DEFINITION_KEYS = ("Name", "Regex")
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is reported as a ConfigError, not on stderr


@dataclass(frozen=True)
class MetricDefinition:
    """One ``{"Name": ..., "Regex": ...}`` entry, its regex compiled once."""

    name: str
    pattern: Any
    """Compiled by RE2, which matches in time linear in the line: no regex can stall the
    controller that reads every line of output (Python's ``re`` takes exponential time on
    ``(a+)+b``)."""

    @property
    def regex(self) -> str:
        return self.pattern.pattern


@dataclass(frozen=True)
class MetricSample:
    """One value of a metric; ``step`` counts that metric's earlier samples (0, 1, 2, ...)."""

    name: str
    value: float
    timestamp: float
    step: int


def validate_metric_definitions(definitions: object) -> tuple[MetricDefinition, ...]:
    """Check ``metric_definitions`` before the job starts, so a bad regex fails fast.

    Each entry needs exactly ``Name`` and ``Regex``; the regex must compile and have a capture
    group, since the metric's value is what the first group captures (as in SageMaker).
    """
    if isinstance(definitions, str | bytes) or not isinstance(definitions, Sequence):
        raise ConfigError(
            "metric_definitions", definitions, 'a list of {"Name": ..., "Regex": ...}'
        )
    parsed: list[MetricDefinition] = []
    for index, entry in enumerate(definitions):
        where = f"metric_definitions[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(where, entry, 'a dict {"Name": ..., "Regex": ...}')
        for key in entry:
            if key not in _DEFINITION_KEYS:
                raise UnknownKeyError(where, str(key), _DEFINITION_KEYS)
        name, regex = entry.get("Name"), entry.get("Regex")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.Name", name, "a non-empty string")
        if any(definition.name == name for definition in parsed):
            raise ConfigError(f"{where}.Name", name, "each metric name at most once")
        key = f"metric_definitions[{name}].Regex"
        if not isinstance(regex, str) or not regex:
            raise ConfigError(key, regex, "a non-empty regular expression string")
        try:
            pattern = re2.compile(regex, _RE2_OPTIONS)
        except re2.error as error:
            detail = error.args[0].decode() if isinstance(error.args[0], bytes) else error
            raise ConfigError(
                key,
                regex,
                f"a regular expression RE2 can run in linear time ({detail}); backreferences "
                "and lookarounds are not available",
            ) from None
        if pattern.groups < 1:
            raise ConfigError(
                key, regex, "a regex with a capture group around the value, e.g. 'loss=([0-9.]+)'"
            )
        parsed.append(MetricDefinition(name, pattern))
    return tuple(parsed)


class MetricExtractor:
    """Turns log lines into metric samples, keeping a per-metric step count across lines."""

    def __init__(
        self, definitions: Sequence[MetricDefinition], clock: Callable[[], float] = time.time
    ) -> None:
        self._definitions = tuple(definitions)
        self._clock = clock
        self._steps = dict.fromkeys((d.name for d in self._definitions), 0)

    def feed(self, line: str) -> list[MetricSample]:
        """Samples in ``line``: at most one per metric, from the first match of its regex.

        A capture that is not a finite number (``nan``, ``abc``) is skipped: it could not be
        plotted or written as JSON in ``FinalMetricDataList``.
        """
        samples = []
        for definition in self._definitions:
            match = definition.pattern.search(line)
            if match is None or match.group(1) is None:
                continue
            try:
                value = float(match.group(1))
            except ValueError:
                continue
            if not math.isfinite(value):
                continue
            step = self._steps[definition.name]
            self._steps[definition.name] = step + 1
            samples.append(MetricSample(definition.name, value, self._clock(), step))
        return samples


def plot_metrics(samples: Sequence[MetricSample], path: str | Path, title: str) -> None:
    """Write a PNG (any format matplotlib infers from ``path``) with one subplot per metric."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not samples:
        raise DtrainError("no metric samples to plot")
    series: dict[str, list[MetricSample]] = {}
    for sample in samples:
        series.setdefault(sample.name, []).append(sample)
    figure = Figure(figsize=(8, 2.5 * len(series) + 0.5), layout="constrained")
    FigureCanvasAgg(figure)  # headless: no display or pyplot global state needed
    figure.suptitle(title)
    axes = figure.subplots(len(series), 1, squeeze=False)[:, 0]
    for ax, (name, points) in zip(axes, sorted(series.items()), strict=True):
        points.sort(key=lambda s: s.step)
        ax.plot([s.step for s in points], [s.value for s in points], marker=".")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    figure.savefig(path)


METRIC_FORMATS = ("table", "csv", "json")


def format_metrics(samples: Sequence[MetricSample], form: str) -> str:
    """``dtrain metrics`` output: an aligned table for people, or CSV / JSON for scripts, one
    row or object per sample with ``metric, step, value, timestamp`` (seconds since the epoch)."""
    if form == "table":
        rows = [f"{'METRIC':24} {'STEP':>6} {'VALUE':>14}\n"]
        rows += [f"{s.name:24} {s.step:>6} {s.value:>14.6g}\n" for s in samples]
        return "".join(rows)
    records = [
        {"metric": s.name, "step": s.step, "value": s.value, "timestamp": s.timestamp}
        for s in samples
    ]
    if form == "json":
        return json.dumps(records, indent=2) + "\n"
    if form == "csv":
        text = io.StringIO()
        writer = csv.DictWriter(text, ["metric", "step", "value", "timestamp"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
        return text.getvalue()
    raise ConfigError("--format", form, ", ".join(METRIC_FORMATS))


def final_metric_data_list(samples: Sequence[MetricSample]) -> list[dict[str, Any]]:
    """DescribeTrainingJob's ``FinalMetricDataList``: each metric's last value, by name."""
    last: dict[str, MetricSample] = {}
    for sample in samples:
        if sample.name not in last or sample.step >= last[sample.name].step:
            last[sample.name] = sample
    return [
        {
            "MetricName": name,
            "Value": sample.value,
            "Timestamp": datetime.datetime.fromtimestamp(
                sample.timestamp, tz=datetime.timezone.utc
            ).isoformat(),
        }
        for name, sample in sorted(last.items())
    ]

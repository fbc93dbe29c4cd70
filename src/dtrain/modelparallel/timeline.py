"""Timelines of pipeline work, planned or measured, and their Chrome trace export.

The schedule simulator produces them from a plan; the runtime records them from a real run. Both
use :class:`TimelineEvent`, so one exporter serves both and the two can be compared.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TimelineEvent:
    """One piece of work on one rank: ``kind`` is ``F``/``B`` (compute) or a send/receive."""

    rank: int
    kind: str
    microbatch: int
    start: float
    end: float
    name: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


def chrome_trace(events: Iterable[TimelineEvent]) -> dict[str, Any]:
    """Chrome trace JSON (chrome://tracing, Perfetto): a row per rank, times in microseconds."""
    trace_events: list[dict[str, Any]] = []
    ranks: set[int] = set()
    for event in events:
        ranks.add(event.rank)
        trace_events.append(
            {
                "name": event.name or f"{event.kind}{event.microbatch}",
                "cat": event.kind,
                "ph": "X",
                "pid": 0,
                "tid": event.rank,
                "ts": event.start * 1e6,
                "dur": max(event.duration, 0.0) * 1e6,
                "args": {"microbatch": event.microbatch},
            }
        )
    for rank in sorted(ranks):
        trace_events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"rank {rank}"},
            }
        )
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[TimelineEvent], path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(events)))

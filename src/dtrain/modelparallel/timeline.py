"""Timelines of pipeline work, planned or measured, and their Chrome trace export.

The schedule simulator produces them from a plan; the runtime records them from a real run
(:class:`TimelineRecorder`). Both use :class:`TimelineEvent`, so one exporter serves both and
the two can be compared.

A real run's timeline has three kinds of communication beside the computations: ``SEND`` (a
stream of messages packed and handed to gloo, which sends it in the background), ``RECV`` (a
stream from its first bytes' arrival until its tensors are rebuilt) and ``WAIT`` (a task waiting
for a reply from another rank, without the compute token). The trace shows each rank as a
process with a row for its computations and rows for each kind of communication; slices that
overlap (two tasks waiting at once) get rows of their own.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMMUNICATION_KINDS = ("SEND", "RECV", "WAIT")
"""The kinds of a real run's events that are not computations."""

_LANES = {"SEND": "send", "RECV": "receive", "WAIT": "wait"}
"""The row of each communication kind (the simulator's ``SEND_F``, ``RECV_B``... by prefix)."""


@dataclass(frozen=True)
class TimelineEvent:
    """One piece of work on one rank: ``kind`` is ``F``/``B``/``I``/``W`` (compute) or a send,
    a receive or a wait."""

    rank: int
    kind: str
    microbatch: int
    start: float
    end: float
    name: str = ""
    peer: int | None = None
    """The other rank of a send, a receive or a wait (global rank)."""
    nbytes: int = 0
    """Bytes of a stream sent or received."""
    visit: int = 0
    """Which of the rank's stages on the microbatch's way a computation was (0 unless the
    microbatch comes back to the rank, a head tied to the embedding)."""

    @property
    def duration(self) -> float:
        return self.end - self.start


class TimelineRecorder:
    """One rank's timeline as it happens, from any thread: the executor's computations, the
    transport's sends and receives, the waits for replies. Times are wall-clock seconds from a
    monotonic clock, so that ranks' timelines line up."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._events: list[TimelineEvent] = []
        self._offset = time.time() - time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() + self._offset

    def add(
        self,
        kind: str,
        microbatch: int,
        start: float,
        name: str,
        peer: int | None = None,
        nbytes: int = 0,
        visit: int = 0,
    ) -> None:
        """An event from ``start`` until now."""
        end = self.now()
        event = TimelineEvent(self.rank, kind, microbatch, start, end, name, peer, nbytes, visit)
        with self._lock:
            self._events.append(event)

    @contextmanager
    def span(
        self, kind: str, microbatch: int, name: str, peer: int | None = None
    ) -> Iterator[None]:
        """An event for the time the ``with`` block takes."""
        start = self.now()
        try:
            yield
        finally:
            self.add(kind, microbatch, start, name, peer)

    def events(self, communication: bool = False) -> list[TimelineEvent]:
        """The computations since the last :meth:`clear`; with ``communication``, also the
        sends, receives and waits."""
        with self._lock:
            events = list(self._events)
        if communication:
            return events
        return [event for event in events if event.kind not in COMMUNICATION_KINDS]

    def clear(self) -> None:
        with self._lock:
            self._events.clear()


def chrome_trace(events: Iterable[TimelineEvent]) -> dict[str, Any]:
    """Chrome trace JSON (chrome://tracing, Perfetto): a process per rank, a row for its
    computations and rows for its sends, receives and waits; times in microseconds."""
    trace_events: list[dict[str, Any]] = []
    lanes: dict[tuple[int, str], list[float]] = {}
    """(rank, row name) -> the end of the last slice in each of its rows."""
    rows: dict[tuple[int, str], int] = {}
    for event in sorted(events, key=lambda e: (e.rank, e.start)):
        kind = next((lane for k, lane in _LANES.items() if event.kind.startswith(k)), "compute")
        ends = lanes.setdefault((event.rank, kind), [])
        lane = next((i for i, end in enumerate(ends) if end <= event.start), len(ends))
        if lane == len(ends):
            ends.append(event.end)
        else:
            ends[lane] = event.end
        row = kind if lane == 0 else f"{kind} {lane + 1}"
        tid = rows.setdefault((event.rank, row), len(rows))
        args: dict[str, Any] = {"microbatch": event.microbatch}
        if event.peer is not None:
            args["peer"] = event.peer
        if event.nbytes:
            args["bytes"] = event.nbytes
        trace_events.append(
            {
                "name": event.name or f"{event.kind}{event.microbatch}",
                "cat": event.kind,
                "ph": "X",
                "pid": event.rank,
                "tid": tid,
                "ts": event.start * 1e6,
                "dur": max(event.duration, 0.0) * 1e6,
                "args": args,
            }
        )
    for rank in sorted({rank for rank, _ in rows}):
        trace_events.append(_metadata("process_name", rank, 0, f"rank {rank}"))
        trace_events.append(_metadata("process_sort_index", rank, 0, rank, key="sort_index"))
    order = list(_LANES.values())
    for (rank, row), tid in rows.items():
        trace_events.append(_metadata("thread_name", rank, tid, row))
        kind = row.split()[0]
        position = 0 if kind == "compute" else 1 + order.index(kind)
        trace_events.append(
            _metadata("thread_sort_index", rank, tid, 100 * position + tid, key="sort_index")
        )
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def _metadata(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def write_chrome_trace(events: Iterable[TimelineEvent], path: str | Path) -> None:
    """Write the trace whole: a reader never sees half a file (it is rewritten every step
    when a job exports it, see ``DTRAIN_MP_TRACE``)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(chrome_trace(events)))
    partial.replace(path)

"""What the web view shows of a job, read through the job store and the job folder.

Everything here is read-only. Paths that come from a request are resolved with
:func:`file_in_job`, which refuses anything that lands outside the job folder.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from dtrain.jobs.describe import describe
from dtrain.jobs.folder import JobFolder
from dtrain.jobs.live import RATE_WINDOW, latest
from dtrain.jobs.logs import log_lines, rank_hosts, rank_logs, unstamped
from dtrain.jobs.metrics import MetricSample
from dtrain.jobs.spec import JobSpec
from dtrain.jobs.store import JobRecord, JobStore
from dtrain.topology import host_name

HIDDEN_FILES = ("spec.json",)
"""Never listed nor served: the request holds the job's environment (credentials, often)."""

MAX_LISTED_FILES = 1000
MAX_VIEW_BYTES = 32 * 1024 * 1024
"""Largest plan or trace JSON the page will draw."""
LOG_CHUNK_BYTES = 256 * 1024
MAX_PLAN_LINES = 5000

_PLAN_HEADER = re.compile(r"^\s*module\s+type\s+placement\s+part\s+params\b")
_PLAN_LAST = re.compile(r"^(slowest partition|traffic |warning)")


def _channel_copies(relative: PurePosixPath) -> bool:
    """``hosts/<host>/input/data/...``: each host's copy of the inputs, not something the job
    made (and as large as the data set)."""
    parts = relative.parts
    return len(parts) >= 4 and parts[0] == "hosts" and parts[2:4] == ("input", "data")


def _submitted(relative: PurePosixPath) -> bool:
    """A host's copy of the job's code or configuration: listed after what the job made."""
    parts = relative.parts
    return len(parts) >= 3 and parts[0] == "hosts" and parts[2] in ("code", "input")


def _job_files(root: Path) -> Iterator[tuple[PurePosixPath, os.stat_result]]:
    """Regular files of the job folder (symbolic links not followed), channel copies left out."""
    for folder, dirs, files in os.walk(root):
        here = PurePosixPath(Path(folder).relative_to(root).as_posix())
        dirs[:] = sorted(d for d in dirs if not _channel_copies(here / d))
        for name in sorted(files):
            relative = here / name
            if str(relative) in HIDDEN_FILES:
                continue
            info = os.lstat(os.path.join(folder, name))
            if stat.S_ISREG(info.st_mode):
                yield relative, info


def file_in_job(record: JobRecord, relative: str) -> Path | None:
    """The file ``relative`` names inside the job's folder, or ``None`` when it is not one.

    Absolute paths, ``..`` and symbolic links whose target lies outside the folder are refused,
    and so are the hidden files and the channel copies. So is whatever the file system cannot
    look up (a NUL byte, a name too long, a loop of links): a request's path is not found, never
    an error of the server.
    """
    root = Path(record.folder).resolve()
    requested = PurePosixPath(relative)
    if not relative or "\0" in relative or "\\" in relative:
        return None
    if requested.is_absolute() or ".." in requested.parts:
        return None
    try:
        path = (root / requested).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            return None
    except (OSError, RuntimeError):  # RuntimeError: a loop of links (Python < 3.13)
        return None
    inside = PurePosixPath(path.relative_to(root).as_posix())
    if str(inside) in HIDDEN_FILES or _channel_copies(inside):
        return None
    return path


def _elapsed(record: JobRecord, now: float) -> float:
    end = record.end_time if record.is_terminal and record.end_time else now
    return max(0.0, end - record.creation_time)


def step_rate(samples: list[MetricSample]) -> dict[str, Any] | None:
    """Steps per second of the metric logged most often, over its last samples, as ``dtrain
    jobs`` shows it (:func:`dtrain.jobs.live.latest`)."""
    found = latest(samples)
    if found is None or found.rate is None:
        return None
    return {"metric": found.sample.name, "per_second": found.rate}


def _layout(spec: JobSpec) -> str:
    return f"{spec.instance_count} × {spec.processes_per_host or 'auto'}"


def job_row(store: JobStore, record: JobRecord, now: float) -> dict[str, Any]:
    """One row of the jobs table."""
    spec = JobSpec.from_json(record.spec)
    return {
        "name": record.name,
        "status": record.status,
        "secondary_status": record.secondary_status,
        "creation_time": record.creation_time,
        "elapsed": _elapsed(record, now),
        "layout": _layout(spec),
        "last_metrics": store.last_metrics(record.name),  # the table is polled: no histories
        "step_rate": step_rate(store.recent_metrics(record.name, RATE_WINDOW)),
    }


def jobs_table(store: JobStore) -> list[dict[str, Any]]:
    now = time.time()
    return [job_row(store, record, now) for record in store.list()]


def _ranks(record: JobRecord, spec: JobSpec) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """The rank logs, each with the host it ran on, and each host's ranks: as each attempt's
    ``ranks.json`` says, or for a job from before it, laid out host by host,
    ``processes_per_host`` each (where that was left to the hosts, one per GPU, the highest
    rank logged tells how many there were)."""
    found = rank_logs(JobFolder(Path(record.folder)).logs_dir)
    per_host = spec.processes_per_host
    world = max((rank for _, rank, _ in found), default=-1) + 1
    if per_host is None and world and world % spec.instance_count == 0:
        per_host = world // spec.instance_count
    recorded = {path.parent: rank_hosts(path.parent) for _, _, path in found}

    def host_of(rank: int, path: Path) -> str | None:
        return recorded[path.parent].get(rank) or (
            host_name(rank // per_host) if per_host else None
        )

    logs = [
        {"attempt": attempt, "rank": rank, "host": host_of(rank, path)}
        for attempt, rank, path in found
    ]
    hosts: dict[str, list[int]] = {}
    last = max((attempt for attempt, _, _ in found), default=None)
    for attempt, rank, path in found:
        host = host_of(rank, path)
        if attempt == last and host is not None:
            hosts.setdefault(host, []).append(rank)
    return logs, dict(sorted(hosts.items(), key=lambda item: item[1]))


def job_detail(store: JobStore, name: str) -> dict[str, Any]:
    """``describe``'s view of the job, with what the page adds: its ranks and files."""
    description = describe(store, name)
    record = store.get(name)
    spec = JobSpec.from_json(record.spec)
    # Names only: values are often credentials, and the page may be seen by others.
    description["Environment"] = sorted(description["Environment"])
    logs, host_ranks = _ranks(record, spec)
    found: list[tuple[bool, str, os.stat_result]] = []
    for relative, info in _job_files(Path(record.folder)):
        if len(found) == MAX_LISTED_FILES * 10:
            break
        found.append((_submitted(relative), str(relative), info))
    files = [
        {"path": path, "size": info.st_size, "modified": info.st_mtime}
        for _, path, info in sorted(found, key=lambda entry: entry[:2])[:MAX_LISTED_FILES]
    ]
    return {
        "description": description,
        "status": record.status,
        "terminal": record.is_terminal,
        "elapsed": _elapsed(record, time.time()),
        "layout": _layout(spec),
        "logs": logs,
        "host_ranks": host_ranks,
        "files": files,
        "files_truncated": len(found) > MAX_LISTED_FILES,
    }


def _json_kind(path: Path, size: int) -> str | None:
    """``trace`` for Chrome trace JSON, ``plan`` for a partition plan's ``to_dict()``; judged
    from the file's start, so that looking costs little."""
    if path.suffix != ".json" or size > MAX_VIEW_BYTES:
        return None
    with path.open("rb") as handle:
        head = handle.read(64 * 1024)
    if b'"traceEvents"' in head:
        return "trace"
    if b'"owners"' in head and b'"stages"' in head:
        return "plan"
    return None


def _plan_in_log(path: Path) -> str | None:
    """The last partition plan table (``model.partition_plan().table()``) a rank printed: from
    its header row to its closing ``slowest partition`` and ``traffic`` lines."""
    found: list[str] | None = None
    block: list[str] | None = None
    closing = False
    for line in log_lines(path):
        if _PLAN_HEADER.match(line):
            block, closing = [line], False
        elif block is not None and _PLAN_LAST.match(line):
            block.append(line)
            closing = True
        elif block is not None and (closing or len(block) > MAX_PLAN_LINES):
            found = block if closing else found
            block, closing = None, False
        elif block is not None:
            block.append(line)
    if block is not None and closing:
        found = block
    return None if found is None else "\n".join(found)


def find_views(record: JobRecord) -> list[dict[str, Any]]:
    """Partition plans and pipeline timelines the job left: JSON files anywhere in its folder
    (``model.export_timeline(...)``, a plan's ``to_dict()``) and plan tables in rank logs."""
    root = Path(record.folder)
    views: list[dict[str, Any]] = []
    for relative, info in _job_files(root):
        kind = _json_kind(root / relative, info.st_size)
        if kind is not None:
            views.append({"kind": kind, "path": str(relative)})
    for _, _, path in rank_logs(JobFolder(root).logs_dir):
        text = _plan_in_log(path)
        if text is not None:
            log = path.relative_to(root).as_posix()
            views.append({"kind": "plan-text", "path": log, "text": text})
    return views


def read_view(record: JobRecord, relative: str) -> dict[str, Any] | None:
    """A plan or trace JSON file of the job, parsed, or ``None`` when it is not one."""
    path = file_in_job(record, relative)
    if path is None:
        return None
    try:  # the job may remove or replace it meanwhile: then it is not found
        kind = _json_kind(path, path.stat().st_size)
        if kind is None:
            return None
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(content, dict):
        return None
    if kind == "trace":
        events = content.get("traceEvents")
        if not isinstance(events, list):
            return None
        return {"kind": kind, "path": relative, "events": _trace_slices(events)}
    return {"kind": kind, "path": relative, "plan": content}


def _trace_slices(events: list[Any]) -> list[dict[str, Any]]:
    """The complete events (``"ph": "X"``) of a Chrome trace, each with its row's name (its
    process's and thread's, as ``rank 0 send``), in the rows' order (their sort indices, as
    Perfetto shows them)."""
    metadata = [e for e in events if isinstance(e, dict) and e.get("ph") == "M"]

    def table(kind: str, key: Callable[[dict[str, Any]], Any]) -> dict[Any, Any]:
        """``kind`` metadata by ``key``: its name or sort index."""
        field = "sort_index" if kind.endswith("sort_index") else "name"
        return {key(e): e.get("args", {}).get(field) for e in metadata if e.get("name") == kind}

    def thread(e: dict[str, Any]) -> tuple[Any, Any]:
        return (e.get("pid"), e.get("tid"))

    def process(e: dict[str, Any]) -> Any:
        return e.get("pid")

    processes = table("process_name", process)
    threads = table("thread_name", thread)
    process_order = table("process_sort_index", process)
    thread_order = table("thread_sort_index", thread)
    slices: list[tuple[tuple[float, float, str], dict[str, Any]]] = []
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        start, duration = event.get("ts"), event.get("dur")
        if not isinstance(start, int | float) or not isinstance(duration, int | float):
            continue
        row = thread(event)
        label = " ".join(str(n) for n in (processes.get(row[0]), threads.get(row)) if n)
        order = (
            _number(process_order.get(row[0]), row[0]),
            _number(thread_order.get(row), row[1]),
            str(row),
        )
        slices.append(
            (
                order,
                {
                    "name": str(event.get("name", "")),
                    "cat": str(event.get("cat", "")),
                    "row": label or f"{row[0]}/{row[1]}",
                    "ts": start,
                    "dur": duration,
                },
            )
        )
    slices.sort(key=lambda pair: pair[0])
    return [slice_ for _, slice_ in slices]


def _number(value: Any, otherwise: Any) -> float:
    """A row's sort index; without one, its id (as trace viewers order them), else last."""
    for candidate in (value, otherwise):
        if isinstance(candidate, int | float):
            return float(candidate)
    return float("inf")


@dataclass(frozen=True)
class LogChunk:
    text: str
    offset: int
    """Where the next read starts."""
    size: int


def log_file(record: JobRecord, rank: int | None, attempt: int | None) -> Path:
    """A rank's log of an attempt, or the controller's log when ``rank`` is ``None``."""
    folder = JobFolder(Path(record.folder))
    if rank is None:
        return folder.controller_log_file
    return folder.log_file(rank, attempt or 1)


def read_log(path: Path, offset: int | None, whole_lines: bool) -> LogChunk:
    """Text of ``path`` from ``offset`` (``None``: its last lines), at most one chunk.

    With ``whole_lines`` (the job is still writing), a last line without its newline is left for
    the next read, so that the page never shows half a line twice.
    """
    if not path.is_file():
        return LogChunk("", 0, 0)
    size = path.stat().st_size
    with path.open("rb") as handle:
        if offset is None:
            start = max(0, size - LOG_CHUNK_BYTES)
            handle.seek(start)
            data = handle.read(LOG_CHUNK_BYTES)
            if start > 0:
                cut = data.find(b"\n") + 1
                data, start = data[cut:], start + cut
        else:
            start = min(max(offset, 0), size)
            handle.seek(start)
            data = handle.read(LOG_CHUNK_BYTES)
    if whole_lines and not data.endswith(b"\n") and len(data) < LOG_CHUNK_BYTES:
        data = data[: data.rfind(b"\n") + 1]
    text = unstamped(data.decode("utf-8", errors="replace"))
    return LogChunk(text, start + len(data), size)

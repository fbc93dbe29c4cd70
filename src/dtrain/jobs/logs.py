"""The job's rank logs: written by the controller, read by ``dtrain logs``.

``logs/attempt-<k>/rank<R>.log`` holds rank R's output in attempt k, one line per line the rank
wrote (a progress bar's redrawn line once, as it ended), each after the UTC time its agent read it:
``2026-11-25T19:09:32.123456Z epoch 1 loss 0.25``. The fixed-width stamps sort as text, so
``sort -m logs/attempt-1/rank*.log`` interleaves the ranks in time as ``dtrain logs`` does.
Every rank's file exists from the start of its attempt, empty until it writes; ``ranks.json``
beside them names each rank's host, for the ``[algo-1,0]`` labels (host, global rank: the rank
``--rank`` takes, ``RANK`` in the rank's environment, unique in the job as a local rank is not).
"""

from __future__ import annotations

import collections
import datetime
import heapq
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from dtrain.jobs.folder import JobFolder

RANKS_FILE = "ranks.json"
SETTLE_SECONDS = 0.5
"""While following, a line is printed once this old: a line of another host read at the same time
may still be on its way, and would otherwise come out of order."""
_STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"
_STAMPED = re.compile(rf"({_STAMP}) (.*)", re.DOTALL)
_STAMPS = re.compile(rf"^{_STAMP} ", re.MULTILINE)


def stamp(when: float) -> str:
    """``when`` as the fixed-width UTC time that starts a log line."""
    moment = datetime.datetime.fromtimestamp(when, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def unstamped(text: str) -> str:
    """Whole lines of a rank's log as the rank wrote them, without their times."""
    return _STAMPS.sub("", text)


def log_lines(path: Path) -> Iterator[str]:
    """A rank log's lines as the rank wrote them, without their times."""
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            yield unstamped(line.rstrip("\n"))


def rank_label(host: str | None, rank: int) -> str:
    """How a rank's lines are labelled, in ``dtrain run``'s console and in ``dtrain logs``."""
    return f"[{host},{rank}]" if host else f"[{rank}]"


def _numbered(folder: Path, pattern: str, prefix: str) -> list[tuple[int, Path]]:
    found = []
    for path in folder.glob(pattern):
        suffix = path.name.removeprefix(prefix).removesuffix(".log")
        if suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def rank_logs(logs_dir: Path, attempt: int | None = None) -> list[tuple[int, int, Path]]:
    """``(attempt, rank, file)`` of the job's rank logs, in order; only ``attempt``'s if given."""
    return [
        (number, rank, path)
        for number, folder in _numbered(logs_dir, "attempt-*", "attempt-")
        if attempt in (None, number)
        for rank, path in _numbered(folder, "rank*.log", "rank")
    ]


def rank_hosts(attempt_dir: Path) -> dict[int, str]:
    """Each rank's host in an attempt (empty for a job from before ``ranks.json``)."""
    try:
        hosts = json.loads(attempt_dir.joinpath(RANKS_FILE).read_text())
        return {int(rank): host for rank, host in hosts.items()}
    except (OSError, ValueError):
        return {}  # a job from before the file: labels without hosts


def labelled_logs(
    logs_dir: Path, rank: int | None = None, attempt: int | None = None
) -> list[tuple[str, Path]]:
    """The logs to print, each with its label: ``[algo-1,0]`` (a retry's names its attempt,
    ``[algo-1,0 attempt 2]``); none for the one rank asked for, but its retries'."""
    files = []
    hosts: dict[Path, dict[int, str]] = {}
    for number, each, path in rank_logs(logs_dir, attempt):
        if rank not in (None, each):
            continue
        retry = f"attempt {number}" if attempt is None and number > 1 else ""
        if rank is not None:
            label = f"[{retry}]" if retry else ""
        else:
            host = hosts.setdefault(path.parent, rank_hosts(path.parent)).get(each)
            label = rank_label(host, each)
            label = f"{label[:-1]} {retry}]" if retry else label
        files.append((label, path))
    return files


class RankLogWriter:
    """The controller's side: opens every rank's log when its attempt starts, appends lines."""

    def __init__(self, folder: JobFolder) -> None:
        self.folder = folder
        self._files: dict[tuple[int, int], TextIO] = {}

    def start_attempt(self, attempt: int, hosts: Mapping[int, str]) -> None:
        """Every rank's (empty) log and the hosts of the ranks, before any rank starts."""
        folder = self.folder.attempt_logs_dir(attempt)
        folder.mkdir(parents=True, exist_ok=True)
        folder.joinpath(RANKS_FILE).write_text(json.dumps({str(r): h for r, h in hosts.items()}))
        for rank in hosts:
            self._open(attempt, rank)

    def _open(self, attempt: int, rank: int) -> TextIO:
        log = self._files.get((attempt, rank))
        if log is None:
            path = self.folder.log_file(rank, attempt)
            path.parent.mkdir(parents=True, exist_ok=True)
            log = self._files[attempt, rank] = path.open("a", encoding="utf-8")
        return log

    def write(self, attempt: int, rank: int, lines: Sequence[tuple[float, str]]) -> None:
        log = self._open(attempt, rank)
        log.write("".join(f"{stamp(when)} {line}\n" for when, line in lines))
        log.flush()

    def close(self) -> None:
        for log in self._files.values():
            log.close()
        self._files.clear()


@dataclass
class _Source:
    """One log file being read: where its next unprinted line starts."""

    label: str
    path: Path
    offset: int = 0
    last_stamp: str = ""

    def lines(self, complete_only: bool) -> Iterator[tuple[str, str, int, _Source]]:
        """``(stamp, text, offset after it, self)`` from the next unprinted line on. A line
        without a stamp (a job from before them) takes the one before it."""
        with self.path.open("r", encoding="utf-8", errors="replace") as handle:
            handle.seek(self.offset)
            while line := handle.readline():
                if complete_only and not line.endswith("\n"):
                    return
                text = line.rstrip("\n")
                match = _STAMPED.fullmatch(text)
                if match:
                    self.last_stamp, text = match.groups()
                yield self.last_stamp, text, handle.tell(), self


def print_logs(
    files: Callable[[], Sequence[tuple[str, Path]]],
    out: TextIO,
    follow: bool = False,
    finished: Callable[[], bool] = lambda: True,
    timestamps: bool = False,
    tail: int | None = None,
    poll_interval: float = 0.2,
) -> None:
    """Print the files' lines interleaved in time, each after its label (and its time, with
    ``timestamps``); only the last ``tail`` lines of what is there at first.

    With ``follow``, keep printing new lines until ``finished()``. ``files`` is called on every
    pass, so logs that appear later (a retry's) are picked up.
    """
    sources: dict[Path, _Source] = {}
    first = True
    while True:
        done = finished()
        for label, path in files():
            sources.setdefault(path, _Source(label, path))
        settled = stamp(time.time() - SETTLE_SECONDS) if follow and not done else None
        merged = heapq.merge(
            *(source.lines(complete_only=not done) for source in sources.values()),
            key=lambda item: item[0],
        )
        shown: collections.deque[str] | None = (
            collections.deque(maxlen=tail) if first and tail is not None else None
        )
        for when, text, end, source in merged:
            if settled is not None and when > settled:
                break
            source.offset = end
            line = (
                (f"{when} " if timestamps else "")
                + (f"{source.label}: " if source.label else "")
                + f"{text}\n"
            )
            if shown is None:
                out.write(line)
            else:
                shown.append(line)
        out.write("".join(shown or ()))
        out.flush()
        first = False
        if not follow or done:
            return
        time.sleep(poll_interval)

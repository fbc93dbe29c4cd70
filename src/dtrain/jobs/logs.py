"""``dtrain logs``: print or follow the per-rank log files of a job, attempt by attempt."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO


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


def labelled_logs(
    logs_dir: Path, rank: int | None = None, attempt: int | None = None
) -> list[tuple[str, Path]]:
    """The logs to print, each with its prefix: ``[rank R]: `` (a retry's names its attempt)."""
    files = []
    for number, each, path in rank_logs(logs_dir, attempt):
        if rank not in (None, each):
            continue
        retry = f"attempt {number}" if attempt is None and number > 1 else ""
        if rank is not None:
            label = f"[{retry}]: " if retry else ""
        else:
            label = f"[{retry}, rank {each}]: " if retry else f"[rank {each}]: "
        files.append((label, path))
    return files


def print_logs(
    files: Callable[[], Sequence[tuple[str, Path]]],
    out: TextIO,
    follow: bool = False,
    finished: Callable[[], bool] = lambda: True,
    poll_interval: float = 0.2,
) -> None:
    """Print each file with its prefix.

    With ``follow``, keep printing new lines until ``finished()``.
    ``files`` is called on every pass, so logs of ranks that start later are picked up.
    """
    offsets: dict[Path, int] = {}
    while True:
        done = finished()
        for prefix, path in files():
            with path.open("r", encoding="utf-8", errors="replace") as handle:
                handle.seek(offsets.get(path, 0))
                while True:
                    line = handle.readline()
                    if not line or (follow and not line.endswith("\n") and not done):
                        break
                    out.write(prefix + line.rstrip("\n") + "\n")
                    offsets[path] = handle.tell()
        out.flush()
        if not follow or done:
            return
        time.sleep(poll_interval)

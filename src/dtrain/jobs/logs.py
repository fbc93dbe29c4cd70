"""``dtrain logs``: print or follow the per-rank log files of a job."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO


def rank_logs(logs_dir: Path) -> list[tuple[int, Path]]:
    """The job's rank log files, in rank order."""
    found = []
    for path in logs_dir.glob("rank*.log"):
        suffix = path.stem.removeprefix("rank")
        if suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


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

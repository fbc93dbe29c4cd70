"""Process-tree control.

Every rank runs in its own process group, and nothing is left behind when a job ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Adopt orphaned grandchildren (Linux), so a daemon a rank forked still gets cleaned up."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        return


def _parent_map() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first), read from ``/proc``; empty elsewhere."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for child, parent in _parent_map().items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    frontier = list(children.get(pid, []))
    while frontier:
        current = frontier.pop()
        found.append(current)
        frontier.extend(children.get(current, []))
    return found


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_pids(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def reap_orphans(keep: Iterable[int] = ()) -> None:
    """Collect exited adopted children so they do not linger as zombies.

    ``keep`` are children a ``Popen`` object still has to wait for (it needs their exit status).
    """
    keep = set(keep)
    me = os.getpid()
    for pid, parent in _parent_map().items():
        if parent != me or pid in keep:
            continue
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def kill_tree(pgids: Iterable[int], grace: float, keep: Iterable[int] = ()) -> None:
    """SIGTERM the groups and every descendant of this process.

    Then SIGKILL what is left after ``grace``.

    ``keep``: see :func:`reap_orphans`.
    """
    pgids = list(pgids)
    keep = list(keep)
    me = os.getpid()
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    signal_pids(descendants(me), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        reap_orphans(keep)
        if not _live(descendants(me)):
            break
        time.sleep(0.05)
    for pgid in pgids:
        signal_group(pgid, signal.SIGKILL)
    signal_pids(descendants(me), signal.SIGKILL)
    reap_orphans(keep)


def _live(pids: Iterable[int]) -> list[int]:
    """Pids that are still running.

    Zombies do not count: they hold no resources but a table slot.
    """
    live = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z":
            live.append(pid)
    return live

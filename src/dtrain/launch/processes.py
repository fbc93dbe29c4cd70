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

from dtrain.procfs import pids, running, stat_fields

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def become_subreaper() -> None:
    """Adopt orphaned grandchildren (Linux), so a daemon a rank forked still gets cleaned up."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def die_with_parent(parent: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """In a child before ``exec``: receive ``sig`` when the thread that started it ends (Linux).

    Call it as ``preexec_fn`` from a thread that lives as long as the child should; the setting
    survives ``exec``. If the parent already died between fork and this call, exit at once.
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _parent_map() -> dict[int, int]:
    parents: dict[int, int] = {}
    for pid in pids():
        fields = stat_fields(pid)
        if fields is not None:
            parents[pid] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first), read from ``/proc``; empty elsewhere."""
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


def kill_tree(
    pgids: Iterable[int], grace: float, keep: Iterable[int] = (), spare: Iterable[int] = ()
) -> None:
    """SIGTERM the groups and every descendant of this process but ``spare``.

    Then SIGKILL what is left after ``grace``.

    ``keep``: see :func:`reap_orphans`.
    """
    pgids = list(pgids)
    keep = list(keep)
    spare = set(spare)
    me = os.getpid()

    def targets() -> list[int]:
        return [pid for pid in descendants(me) if pid not in spare]

    first = targets()  # before any dies: an orphan may be adopted by someone else
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    signal_pids(first, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        reap_orphans(keep)
        if not any(running(pid) for pid in targets()):
            break
        time.sleep(0.05)
    for pgid in pgids:
        signal_group(pgid, signal.SIGKILL)
    signal_pids(targets(), signal.SIGKILL)
    reap_orphans(keep)


def marked_processes(marker: bytes) -> list[int]:
    """Live processes whose environment holds ``marker`` (a ``KEY=VALUE`` line), from ``/proc``.

    An environment is inherited by every descendant, through ``setsid`` and double forks, so this
    finds what a rank started even after its parent is gone.
    """
    found = []
    for pid in pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:
            continue
        if marker in environ and running(pid):
            found.append(pid)
    return found

"""Processes as Linux's ``/proc`` shows them; where there is no ``/proc``, none.

Below both the job layer, which waits for a job's controller to exit before removing its folder
(:mod:`dtrain.jobs.cleanup`), and the launcher, which ends what a job started
(:mod:`dtrain.launch.processes`).
"""

from __future__ import annotations

import os


def pids() -> list[int]:
    """Every process id there is."""
    if not os.path.isdir("/proc"):
        return []
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, parent id, ...), or
    ``None`` for a process that is gone. The name is cut at its last ``)``: it may hold spaces
    and parentheses of its own."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def running(pid: int) -> bool:
    """The process runs. A zombie, ended but not yet reaped by its parent, does not: it holds no
    resources but a table slot."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != b"Z"

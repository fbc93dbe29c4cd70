"""Processes as /proc shows them: running, zombie, gone, and a name that holds a parenthesis."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from dtrain.procfs import pids, running, stat_fields

_PR_SET_NAME = 15


def test_a_child_runs_then_is_a_zombie_then_is_gone() -> None:
    ready_read, ready_write = os.pipe()
    go_read, go_write = os.pipe()
    prctl = ctypes.CDLL(None).prctl  # loaded before the fork: the child only calls it
    child = os.fork()
    if child == 0:  # named as a command may be, then waits for the parent to look
        os.close(go_write)
        prctl(_PR_SET_NAME, b"x) (y", 0, 0, 0)
        os.write(ready_write, b"!")
        os.read(go_read, 1)
        os._exit(0)
    for end in (ready_write, go_read):
        os.close(end)
    try:
        assert os.read(ready_read, 1) == b"!"
        assert Path(f"/proc/{child}/comm").read_bytes() == b"x) (y\n"
        assert child in pids() and running(child) and running(os.getpid())
        fields = stat_fields(child)
        assert fields is not None and fields[1] == str(os.getpid()).encode()
    finally:
        for end in (ready_read, go_write):  # the child reads the end of the pipe and exits
            os.close(end)
    os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)  # ended, not yet reaped
    assert stat_fields(child) is not None and not running(child)
    os.waitpid(child, 0)
    assert stat_fields(child) is None and not running(child) and child not in pids()

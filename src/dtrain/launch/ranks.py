"""The ranks of one host: started together, their output passed on line by line, stopped together.

Each rank runs in its own session (a Ctrl-C at the terminal reaches the agent, which stops them in
order), dies with the thread that started it (``PR_SET_PDEATHSIG``: an agent killed with SIGKILL
takes its ranks along) and carries ``marker`` in its environment, by which the host's keeper
finds whatever a rank started if the agent itself is gone.
"""

from __future__ import annotations

import collections
import functools
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dtrain.launch.lines import drawn_so_far, live_frame, settle, split_lines
from dtrain.launch.outcome import TRACEBACK_HEAD, error_tail
from dtrain.launch.processes import die_with_parent, kill_tree

TAIL_LINES = 200
"""Lines of a rank's output kept for its failure report."""
RECENT_TRACEBACK_LINES = 30
"""A traceback this close to the end of the output is the one the rank died of."""
READ_BYTES = 1 << 16


@dataclass(frozen=True)
class RankLaunch:
    """How to start one rank: ``env`` is its whole environment."""

    rank: int
    argv: list[str]
    env: dict[str, str]
    cwd: Path


@dataclass(frozen=True)
class RankExit:
    """A rank's end: its return code (negative: killed by that signal) and its last words."""

    rank: int
    code: int
    time: float
    """When it failed: the moment its last traceback began, else when it exited."""
    tail: str
    stopped: bool
    """It was being stopped when it ended, so its exit says nothing about the job."""


class _Rank:
    def __init__(self, launch: RankLaunch, process: subprocess.Popen[bytes]) -> None:
        self.launch = launch
        self.process = process
        self.lines: collections.deque[tuple[float, str]] = collections.deque(maxlen=TAIL_LINES)
        self.traceback_time: float | None = None
        self.reader: threading.Thread | None = None
        self.waiting = False
        """The reader has handled all it read and waits for more (or is about to)."""
        self.reported = False


class LocalRanks:
    """Starts the host's ranks and watches them; ``on_line(rank, line)`` gets every output line
    (a progress line once, as it ended: :func:`settle`), ``on_frame(rank, frame)`` the progress
    line being drawn after each read (``None``: none).

    ``start`` and ``stop`` belong to one thread that outlives the ranks (their parent-death
    signal follows that thread); the callbacks are called from one reader thread per rank.
    """

    def __init__(
        self,
        launches: Sequence[RankLaunch],
        on_line: Callable[[int, str], None],
        grace: float = 3.0,
        spare: Sequence[int] = (),
        on_frame: Callable[[int, str | None], None] = lambda rank, frame: None,
    ) -> None:
        self.launches = list(launches)
        self.on_line = on_line
        self.on_frame = on_frame
        self.grace = grace
        self.spare = list(spare)  # children of this process that are not the ranks' (the keeper)
        self._ranks: list[_Rank] = []
        self._stopping = False

    def start(self) -> None:
        parent = os.getpid()
        for launch in self.launches:
            process = subprocess.Popen(
                launch.argv,
                cwd=launch.cwd,
                env=launch.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, parent),
            )
            rank = _Rank(launch, process)
            rank.reader = threading.Thread(
                target=self._pump, args=(rank,), name=f"rank{launch.rank}-output", daemon=True
            )
            rank.reader.start()
            self._ranks.append(rank)

    def _pump(self, rank: _Rank) -> None:
        assert rank.process.stdout is not None
        descriptor = rank.process.stdout.fileno()
        partial = b""
        while True:
            rank.waiting = True
            chunk = os.read(descriptor, READ_BYTES)
            rank.waiting = False
            if not chunk:
                break
            lines, partial = split_lines(partial, chunk)
            partial = drawn_so_far(partial)
            for line in lines:
                self._take(rank, line)
            self.on_frame(rank.launch.rank, live_frame(partial))
        if partial:
            self._take(rank, partial)
            self.on_frame(rank.launch.rank, None)

    def _take(self, rank: _Rank, raw: bytes) -> None:
        line = settle(raw.decode("utf-8", errors="replace"))
        now = time.time()
        if line == TRACEBACK_HEAD:
            rank.traceback_time = now
        rank.lines.append((now, line))
        self.on_line(rank.launch.rank, line)

    @property
    def running(self) -> bool:
        return any(not rank.reported for rank in self._ranks)

    def poll(self) -> list[RankExit]:
        """Ranks that exited since the last call, each once, after the rest of their output."""
        exits = []
        for rank in self._ranks:
            if rank.reported or rank.process.poll() is None:
                continue
            exit_time = time.time()
            self._drain(rank)
            rank.reported = True
            exits.append(self._exit(rank, exit_time))
        return exits

    @staticmethod
    def _drain(rank: _Rank) -> None:
        """Wait until the reader has handled every line the exited rank wrote: its pipe ended,
        or holds nothing (not even its end) while the reader waits on it. Whatever the rank
        wrote is in the pipe by the time it exits (a write to a full pipe blocks), so this waits
        for no timer, however slowly the reader runs; a grandchild that keeps the pipe open
        does not hold the exit back."""
        assert rank.reader is not None and rank.process.stdout is not None
        pipe = rank.process.stdout.fileno()
        while rank.reader.is_alive() and not (rank.waiting and not _readable(pipe)):
            rank.reader.join(timeout=0.01)

    def _exit(self, rank: _Rank, exit_time: float) -> RankExit:
        code = rank.process.returncode
        lines = list(rank.lines)
        recent = [when for when, line in lines[-RECENT_TRACEBACK_LINES:] if line == TRACEBACK_HEAD]
        failed_at = recent[-1] if code != 0 and recent else exit_time
        tail = error_tail("\n".join(line for _, line in lines)) if code != 0 else ""
        return RankExit(rank.launch.rank, code, failed_at, tail, self._stopping)

    def stop(self) -> None:
        """SIGTERM every rank's group and every descendant of this process; SIGKILL after grace."""
        self._stopping = True
        running = [rank for rank in self._ranks if rank.process.poll() is None]
        pids = [rank.process.pid for rank in self._ranks]
        kill_tree(pids, self.grace if running else 0.0, keep=pids + self.spare, spare=self.spare)
        for rank in self._ranks:
            rank.process.wait()


def _readable(descriptor: int) -> bool:
    """Data, or the end, waits to be read."""
    return bool(select.select([descriptor], [], [], 0)[0])

"""Run a job's ranks, mirror their output, and end the whole job as soon as one rank fails."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from dtrain.launch.processes import become_subreaper, kill_tree

TRACEBACK_HEAD = "Traceback (most recent call last):"
TAIL_LINES = 30


@dataclass(frozen=True)
class RankLaunch:
    """How to start one rank."""

    rank: int
    host: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_file: Path

    @property
    def label(self) -> str:
        return f"{self.host} rank {self.rank}"


@dataclass(frozen=True)
class RankFailure:
    """The first rank that ended badly, and what it said last."""

    rank: int
    host: str
    exit_code: int | None
    signal_name: str | None
    tail: str

    @property
    def reason(self) -> str:
        how = (
            f"was killed by {self.signal_name}"
            if self.signal_name
            else f"exited with code {self.exit_code}"
        )
        last = self.tail.strip().splitlines()[-1] if self.tail.strip() else "no output"
        return f"rank {self.rank} ({self.host}) {how}: {last}"


@dataclass(frozen=True)
class Outcome:
    """How the ranks ended: Completed, Failed (with the rank) or Stopped (with why)."""

    status: str
    secondary_status: str
    failure: RankFailure | None = None
    message: str = ""


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last traceback in a rank's log (or its last lines), for the failure reason."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    start = text.rfind(TRACEBACK_HEAD)
    tail = text[start:] if start >= 0 else text
    return "\n".join(tail.splitlines()[-lines:])


@dataclass
class _Rank:
    launch: RankLaunch
    process: subprocess.Popen[bytes]
    reader: threading.Thread
    exit_time: float | None = None


@dataclass
class Supervisor:
    """Starts every rank in its own process group and watches them.

    Output of each rank goes to its log file and, prefixed with host and rank, to ``console``.
    ``should_stop`` is polled so that Ctrl-C, ``dtrain stop`` and ``--max-run`` all end the job the
    same way: SIGTERM to every rank's group, SIGKILL after ``grace`` seconds.
    """

    launches: Sequence[RankLaunch]
    console: TextIO | None = None
    on_line: Callable[[int, str], None] | None = None
    should_stop: Callable[[], str | None] = lambda: None
    max_run: float | None = None
    grace: float = 3.0
    poll_interval: float = 0.05
    on_progress: Callable[[float], None] | None = None
    progress_interval: float = 30.0
    _ranks: list[_Rank] = field(default_factory=list)
    _console_lock: threading.Lock = field(default_factory=threading.Lock)
    _interrupted: str | None = None

    def run(self) -> Outcome:
        become_subreaper()
        previous = self._install_signal_handlers()
        try:
            self._start()
            return self._watch()
        finally:
            self._stop_all()
            self._restore_signal_handlers(previous)

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def interrupt(signum: int, _frame: object) -> None:
            self._interrupted = f"Interrupted by {signal.Signals(signum).name}"

        return {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _start(self) -> None:
        for launch in self.launches:
            launch.log_file.parent.mkdir(parents=True, exist_ok=True)
            process = subprocess.Popen(
                launch.argv,
                cwd=launch.cwd,
                env=launch.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            reader = threading.Thread(
                target=self._pump, args=(launch, process), name=f"rank{launch.rank}-output"
            )
            reader.daemon = True
            reader.start()
            self._ranks.append(_Rank(launch, process, reader))

    def _pump(self, launch: RankLaunch, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        prefix = f"[{launch.host},{launch.rank}]: "
        with launch.log_file.open("w", encoding="utf-8") as log:
            for raw in process.stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                if self.console is not None:
                    with self._console_lock:
                        self.console.write(prefix + line + "\n")
                        self.console.flush()
                if self.on_line is not None:
                    self.on_line(launch.rank, line)

    def _watch(self) -> Outcome:
        started = time.monotonic()
        last_progress = started
        while True:
            failure = self._first_failure()
            if failure is not None:
                return Outcome("Failed", "Failed", failure, failure.reason)
            if all(rank.process.returncode is not None for rank in self._ranks):
                return Outcome("Completed", "Completed", message="Training job completed")
            stop_reason = self._interrupted or self.should_stop()
            if stop_reason:
                return Outcome("Stopped", "Stopped", message=stop_reason)
            now = time.monotonic()
            if self.max_run is not None and now - started > self.max_run:
                return Outcome(
                    "Stopped",
                    "MaxRuntimeExceeded",
                    message=f"Training job exceeded MaxRuntimeInSeconds ({self.max_run:g} s)",
                )
            if self.on_progress is not None and now - last_progress >= self.progress_interval:
                self.on_progress(now - started)
                last_progress = now
            time.sleep(self.poll_interval)

    def _first_failure(self) -> RankFailure | None:
        """The earliest rank to exit non-zero.

        Ranks that died of SIGTERM/SIGPIPE after it are collateral.
        """
        now = time.monotonic()
        for rank in self._ranks:
            if rank.exit_time is None and rank.process.poll() is not None:
                rank.exit_time = now
        failed = [r for r in self._ranks if r.exit_time is not None and r.process.returncode != 0]
        if not failed:
            return None
        failed.sort(key=lambda r: (r.exit_time, r.process.returncode in (-15, -13)))
        first = failed[0]
        first.reader.join(timeout=5)
        code = first.process.returncode
        signal_name = signal.Signals(-code).name if code < 0 else None
        return RankFailure(
            rank=first.launch.rank,
            host=first.launch.host,
            exit_code=None if signal_name else code,
            signal_name=signal_name,
            tail=log_tail(first.launch.log_file),
        )

    def _stop_all(self) -> None:
        running = [r for r in self._ranks if r.process.poll() is None]
        kill_tree(
            (r.process.pid for r in self._ranks),
            self.grace if running else 0.0,
            keep=(r.process.pid for r in self._ranks),
        )
        for rank in self._ranks:
            rank.process.wait()
            rank.reader.join(timeout=5)

"""How one attempt of a job ends, decided from what the hosts report: no threads, no processes.

The controller feeds an :class:`Attempt` every report (a rank's exit, a host's loss, a host done, a
stop request) and does what it answers: stop every host at the first failure or stop request, end
when every host is done or lost. The outcome names the root cause: the earliest failure by time,
ranks that failed because a peer had died (their errors say so) ranking after the rest, and exits
of ranks that the controller was already stopping not counting at all.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

COMPLETED = "Completed"
FAILED = "Failed"
STOPPED = "Stopped"

TRACEBACK_HEAD = "Traceback (most recent call last):"

COLLATERAL_ERRORS = re.compile(
    "|".join(
        (
            r"Connection closed by peer",  # gloo
            r"Connection reset by peer",
            r"Broken pipe",
            r"remote process exited",  # NCCL
            r"transport failed",
            r"failed to recv, got 0 bytes",  # torch's TCPStore client
        )
    )
)
"""What a rank's error says when it failed because a peer died, not of a fault of its own."""

RAISED_ON_RANK = re.compile(r"raised on rank (\d+)")
"""dtrain.modelparallel's RemoteError: the error is that rank's (collateral on any other)."""


@dataclass(frozen=True)
class Failure:
    """A rank that ended badly, or a host that was lost (``rank`` None)."""

    host: str
    rank: int | None
    time: float
    """When it happened, as seen on the host that reported it (seconds since the epoch)."""
    how: str
    """``exited with code 1``, ``was killed by SIGKILL``, ``was lost: ...``."""
    tail: str = ""
    """The rank's last traceback, or its last lines of output."""
    signal_name: str | None = None
    lost: bool = False
    """The host is gone (its agent died, its machine or link went down), not just failed."""

    @property
    def error(self) -> str:
        """The last line of the tail: for a Python rank, the exception type and message."""
        lines = self.tail.strip().splitlines()
        return lines[-1].strip() if lines else ""

    @property
    def collateral(self) -> bool:
        if self.rank is None:
            return False
        if COLLATERAL_ERRORS.search(self.tail):
            return True
        return any(int(rank) != self.rank for rank in RAISED_ON_RANK.findall(self.tail))

    @property
    def infrastructure(self) -> bool:
        """A failure outside the script's code (killed rank, lost host): worth a retry."""
        return self.lost or self.signal_name is not None

    @property
    def reason(self) -> str:
        """The job's ``FailureReason``; :func:`failed_rank` reads its rank back."""
        who = f"host {self.host}" if self.rank is None else f"rank {self.rank} ({self.host})"
        return f"{who} {self.how}: {self.error}" if self.error else f"{who} {self.how}"


_REASON_RANK = re.compile(r"rank (\d+) \(")


def failed_rank(reason: str) -> int | None:
    """The rank a :attr:`Failure.reason` names (``rank 3 (algo-2) exited with code 1: ...``);
    ``None`` for a lost host or any other reason."""
    named = _REASON_RANK.match(reason)
    return int(named.group(1)) if named else None


def exit_description(code: int) -> tuple[str, str | None]:
    """``(how, signal name)`` for a process's return code (negative: killed by that signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}", name
    return f"exited with code {code}", None


def rank_failure(host: str, rank: int, code: int, time: float, tail: str) -> Failure:
    how, signal_name = exit_description(code)
    return Failure(host, rank, time, how, tail, signal_name)


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended: Completed, Failed (with the root cause) or Stopped (with why)."""

    status: str
    secondary_status: str
    message: str
    failure: Failure | None = None

    @property
    def retryable(self) -> bool:
        return self.status == FAILED and self.failure is not None and self.failure.infrastructure


@dataclass
class Attempt:
    """One run of every rank on every host, from start to the last host done or lost."""

    number: int
    hosts: tuple[str, ...]
    _done: set[str] = field(default_factory=set)
    _failures: list[Failure] = field(default_factory=list)
    _stop: tuple[str, str] | None = None  # (secondary status, message) of a stop request
    _stopping: bool = False

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def done_hosts(self) -> frozenset[str]:
        return frozenset(self._done)

    @property
    def ended(self) -> bool:
        return self._done >= set(self.hosts)

    def rank_exited(self, failure: Failure | None, stopped: bool) -> bool:
        """A rank ended (``failure`` None: exit code 0); ``stopped``: it was being stopped.

        Returns whether every host must now be stopped.
        """
        if failure is None or stopped:
            return False
        self._failures.append(failure)
        return self._begin_stop()

    def host_lost(self, failure: Failure) -> bool:
        """A host is gone or broken (agent died, link down): its ranks can no longer report."""
        self._done.add(failure.host)
        self._failures.append(failure)
        return self._begin_stop()

    def host_done(self, host: str) -> None:
        """Every rank of ``host`` has exited and reported."""
        self._done.add(host)

    def request_stop(self, secondary_status: str, message: str) -> bool:
        """Ctrl-C, ``dtrain stop``, ``--max-run``: honoured unless a failure came first."""
        if self._stop is None and not self._failures:
            self._stop = (secondary_status, message)
        return self._begin_stop()

    def _begin_stop(self) -> bool:
        first = not self._stopping
        self._stopping = True
        return first

    def root_cause(self) -> Failure | None:
        if not self._failures:
            return None
        return min(self._failures, key=lambda f: (f.collateral, f.time))

    def outcome(self) -> Outcome:
        if self._stop is not None:
            secondary, message = self._stop
            return Outcome(STOPPED, secondary, message)
        cause = self.root_cause()
        if cause is not None:
            return Outcome(FAILED, FAILED, cause.reason, cause)
        return Outcome(COMPLETED, COMPLETED, "Training job completed")


def error_tail(text: str, lines: int = 30) -> str:
    """The last traceback in a rank's output (or its last lines), for the failure reason."""
    start = text.rfind(TRACEBACK_HEAD)
    tail = text[start:] if start >= 0 else text
    return "\n".join(tail.splitlines()[-lines:])

"""What a stalled pipeline waits for, and which rank holds it up.

When nothing has moved on a rank in a step for a while (``DTRAIN_MP_STALL_REPORT`` seconds,
see :mod:`..options`), each rank of the pipeline publishes what it waits for (peer, request,
microbatch) and what it is doing, reads the others' through the job's rendezvous store, and the
diagnosis names the ranks that wait for nobody: those are stuck in their own work (a module that
never returns, a script that never reaches the step), and the rest wait on them. The diagnosis
is printed and joins the timeout error that ends the step later, so the job's failure names the
culprit, not the first rank to give up.

Outside a step silence is the script's own business (an evaluation, a checkpoint upload): a
rank reports nothing then, but keeps its state in the store, so that peers stalled in a step
can tell a script that never reaches the step from a rank that is gone.

:class:`WaitBoard` and :func:`diagnose` are plain data and logic, tested without processes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

GATHER_S = 5.0
"""How long a rank waits for its peers' reports once it published its own."""


@dataclass(frozen=True)
class Wait:
    peer: int
    """The global rank waited on."""
    what: str
    """``forward request #12 for module 'b' (microbatch 1)``, ``the end of step 3``."""
    since: float
    """Wall-clock time the wait began (comparable across ranks)."""
    blocking: bool = True
    """False for a rank that waits for the step's end while it serves requests: it holds
    nobody up by waiting."""


@dataclass(frozen=True)
class RankState:
    rank: int
    doing: str
    """What this rank's compute token is doing (``served 'b' F1 since 12:00:01``)."""
    waits: tuple[Wait, ...] = ()

    @property
    def blocked(self) -> bool:
        return any(w.blocking for w in self.waits)

    def to_wire(self) -> str:
        waits = [[w.peer, w.what, w.since, w.blocking] for w in self.waits]
        return json.dumps({"rank": self.rank, "doing": self.doing, "waits": waits})

    @classmethod
    def from_wire(cls, text: str) -> RankState:
        value = json.loads(text)
        waits = tuple(Wait(int(p), str(w), float(s), bool(b)) for p, w, s, b in value["waits"])
        return cls(int(value["rank"]), str(value["doing"]), waits)


class WaitBoard:
    """The waits on other ranks in progress on this rank (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[int, Wait] = {}
        self._keys = itertools.count()

    @contextlib.contextmanager
    def waiting(self, peer: int, what: str, blocking: bool = True) -> Iterator[None]:
        key = next(self._keys)
        with self._lock:
            self._waits[key] = Wait(peer, what, time.time(), blocking)
        try:
            yield
        finally:
            with self._lock:
                del self._waits[key]

    def snapshot(self) -> tuple[Wait, ...]:
        with self._lock:
            return tuple(sorted(self._waits.values(), key=lambda w: w.since))


def diagnose(ranks: list[int], states: dict[int, RankState], silence: float) -> str:
    """The report of a pipeline (global ``ranks``) silent for ``silence`` seconds."""
    lines = [f"pipeline stalled: nothing moved for {silence:.0f} s"]
    culprits = [r for r in ranks if r in states and not states[r].blocked]
    silent = [r for r in ranks if r not in states]
    if culprits:
        lines[0] += "; " + ", ".join(f"rank {r}" for r in culprits) + " waits for nobody"
    elif silent:
        lines[0] += "; " + ", ".join(f"rank {r}" for r in silent) + " sent no report"
    else:
        lines[0] += "; every rank waits for another (a cycle)"
    for rank in ranks:
        state = states.get(rank)
        if state is None:
            lines.append(f"  rank {rank}: no report (stuck outside Python, or gone)")
            continue
        if not state.blocked:
            lines.append(f"  rank {rank}: waits for nobody; {state.doing}")
        else:
            lines.append(f"  rank {rank}: {state.doing}; waits for")
        lines.extend(
            f"    rank {w.peer}: {w.what}" + ("" if w.blocking else " (serving meanwhile)")
            for w in state.waits
        )
    return "\n".join(lines)


class Store(Protocol):
    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def add(self, key: str, amount: int) -> int: ...


@dataclass
class StallWatch:
    """A thread that notices a silence and reports it (once per silence)."""

    rank: int
    ranks: list[int]
    limit: float
    last_progress: Callable[[], float]
    """Monotonic time anything last moved on this rank (a step's start included)."""
    in_step: Callable[[], bool]
    state: Callable[[], RankState]
    store: Store | None
    publish: Callable[[str], None]
    """Where the report goes (stderr)."""
    report: str | None = None
    """The last diagnosis, for the timeout error that may follow."""
    report_time: float = 0.0
    """Monotonic time of the last diagnosis."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _reported_at: float = -1.0
    _shared_at: float = float("-inf")

    def start(self) -> None:
        name = f"dtrain-mp-stall-{self.rank}"
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(min(1.0, self.limit / 4)):
            progress = self.last_progress()
            silence = time.monotonic() - progress
            if silence < self.limit:
                continue
            with contextlib.suppress(Exception):  # a report must never break the job
                if not self.in_step():
                    self._share()
                elif self._reported_at != progress:
                    self._reported_at = progress
                    self._report(silence)

    def recent_report(self, within: float) -> str | None:
        """The last diagnosis if made in the last ``within`` seconds (an older one describes
        another silence)."""
        if self.report is not None and time.monotonic() - self.report_time <= within:
            return self.report
        return None

    def _key(self, rank: int) -> str:
        return f"dtrain/mp-stall/{rank}"

    def _publish_state(self, own: RankState, now: float) -> None:
        assert self.store is not None
        self.store.set(self._key(self.rank), json.dumps({"at": now, "state": own.to_wire()}))
        self._shared_at = time.monotonic()

    def _share(self) -> None:
        """Outside a step: this rank's state for peers' reports, renewed before it is older
        than a report accepts."""
        if self.store is not None and time.monotonic() - self._shared_at >= self.limit / 2:
            self._publish_state(self.state(), time.time())

    def _report(self, silence: float) -> None:
        own = self.state()
        states = {self.rank: own}
        if self.store is not None:
            now = time.time()
            self._publish_state(own, now)
            states.update(self._gather(now))
        self.report = diagnose(self.ranks, states, silence)
        self.report_time = time.monotonic()
        self.publish(f"dtrain: rank {self.rank}: {self.report}")

    def _gather(self, now: float) -> dict[int, RankState]:
        """The peers' reports of this silence (those written since it began)."""
        assert self.store is not None
        found: dict[int, RankState] = {}
        deadline = time.monotonic() + GATHER_S
        while len(found) < len(self.ranks) - 1 and time.monotonic() < deadline:
            for rank in self.ranks:
                if rank == self.rank or rank in found or not self.store.check([self._key(rank)]):
                    continue
                value: dict[str, Any] = json.loads(self.store.get(self._key(rank)))
                if value["at"] >= now - self.limit:
                    found[rank] = RankState.from_wire(value["state"])
            self._stop.wait(0.2)
        return found


def default_store() -> Store | None:
    """The job's rendezvous store, if the world has one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None

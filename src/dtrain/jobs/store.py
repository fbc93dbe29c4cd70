"""The job store: one SQLite file under ``DTRAIN_HOME``.

Several jobs and CLI calls share it safely.
"""

from __future__ import annotations

import builtins
import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError, did_you_mean
from dtrain.jobs.folder import create_private_file, dtrain_home
from dtrain.jobs.metrics import MetricSample

IN_PROGRESS = "InProgress"
COMPLETED = "Completed"
FAILED = "Failed"
STOPPING = "Stopping"
STOPPED = "Stopped"
TERMINAL_STATUSES = (COMPLETED, FAILED, STOPPED)
STATUSES = (IN_PROGRESS, COMPLETED, FAILED, STOPPING, STOPPED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    secondary_status TEXT NOT NULL,
    failure_reason TEXT,
    creation_time REAL NOT NULL,
    start_time REAL,
    end_time REAL,
    last_modified REAL NOT NULL,
    spec TEXT NOT NULL,
    folder TEXT NOT NULL,
    supervisor_pid INTEGER,
    model_artifacts TEXT
);
CREATE TABLE IF NOT EXISTS transitions (
    job TEXT NOT NULL,
    status TEXT NOT NULL,
    start_time REAL NOT NULL,
    message TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
    job TEXT NOT NULL,
    name TEXT NOT NULL,
    step INTEGER NOT NULL,
    value REAL NOT NULL,
    timestamp REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS hosts (
    job TEXT NOT NULL,
    position INTEGER NOT NULL,
    facts TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS metrics_by_job ON metrics (job, name, step);
CREATE INDEX IF NOT EXISTS transitions_by_job ON transitions (job, start_time);
"""


@dataclass(frozen=True)
class Transition:
    status: str
    start_time: float
    message: str


@dataclass(frozen=True)
class JobRecord:
    """A row of the ``jobs`` table."""

    name: str
    status: str
    secondary_status: str
    failure_reason: str | None
    creation_time: float
    start_time: float | None
    end_time: float | None
    last_modified: float
    spec: str
    folder: str
    supervisor_pid: int | None
    model_artifacts: str | None

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class StillRunning(DtrainError):
    """A job had not ended when a wait for it (:meth:`JobStore.wait`) gave up."""

    def __init__(self, record: JobRecord, waited: float) -> None:
        self.record = record
        self.waited = waited
        super().__init__(f"job {record.name} is still {record.status} after {waited:g} s")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class JobStore:
    """Jobs, their status transitions and metric time series.

    WAL mode plus a busy timeout lets concurrent jobs write while ``dtrain jobs`` reads.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or dtrain_home() / "jobs.db"
        create_private_file(self.path)  # SQLite's own files (WAL, shared memory) take its mode
        with self._connect() as db:
            db.executescript(_SCHEMA)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=30000")
            db.row_factory = sqlite3.Row
            yield db
        finally:
            db.close()

    def create(self, name: str, spec: str, folder: Path) -> None:
        now = time.time()
        with self._connect() as db:
            try:
                db.execute(
                    "INSERT INTO jobs (name, status, secondary_status, creation_time,"
                    " last_modified, spec, folder) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (name, IN_PROGRESS, "Starting", now, now, spec, str(folder)),
                )
            except sqlite3.IntegrityError:
                raise DtrainError(
                    f"job name {name!r} is already used; choose another --job-name"
                ) from None
            db.execute(
                "INSERT INTO transitions VALUES (?, ?, ?, ?)",
                (name, "Starting", now, "Preparing the instances for training"),
            )

    def update(
        self,
        name: str,
        *,
        status: str | None = None,
        secondary_status: str | None = None,
        message: str = "",
        failure_reason: str | None = None,
        start_time: float | None = None,
        end_time: float | None = None,
        supervisor_pid: int | None = None,
        model_artifacts: str | None = None,
    ) -> None:
        """Change the given columns; a new secondary status is also recorded as a transition,
        starting at ``end_time`` when that is given (a job's last transition ends with the job,
        not before it starts)."""
        now = time.time()
        transition_start = now if end_time is None else end_time
        columns: dict[str, Any] = {
            "status": status,
            "secondary_status": secondary_status,
            "failure_reason": failure_reason,
            "start_time": start_time,
            "end_time": end_time,
            "supervisor_pid": supervisor_pid,
            "model_artifacts": model_artifacts,
        }
        columns = {k: v for k, v in columns.items() if v is not None}
        columns["last_modified"] = now
        assignments = ", ".join(f"{column} = ?" for column in columns)
        with self._connect() as db:
            db.execute(f"UPDATE jobs SET {assignments} WHERE name = ?", (*columns.values(), name))
            if secondary_status is not None:
                db.execute(
                    "INSERT INTO transitions VALUES (?, ?, ?, ?)",
                    (name, secondary_status, transition_start, message),
                )

    def request_stop(self, name: str) -> JobRecord:
        """Mark a running job ``Stopping``; its supervisor polls for this and stops every rank."""
        record = self.get(name)
        if record.is_terminal:
            raise DtrainError(f"job {name!r} is already {record.status}; nothing to stop")
        self.update(name, status=STOPPING, secondary_status="Stopping", message="Stop requested")
        return self.get(name)

    def get(self, name: str) -> JobRecord:
        with self._connect() as db:
            row = db.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
            if row is None:
                names = [r["name"] for r in db.execute("SELECT name FROM jobs")]
        if row is None:
            suggestion = did_you_mean(name, names)
            hint = f"; did you mean {suggestion!r}?" if suggestion else "; `dtrain jobs` lists them"
            raise DtrainError(f"no job named {name!r}{hint}")
        return self._reconcile(JobRecord(**dict(row)))

    def wait(self, name: str, timeout: float | None = None, poll: float = 0.2) -> JobRecord:
        """The job's record once it has ended, read again every ``poll`` seconds (a job whose
        controller died ends Failed here, see :meth:`get`); after ``timeout`` seconds, if given,
        :class:`StillRunning`."""
        started = time.monotonic()
        while not (record := self.get(name)).is_terminal:
            if timeout is not None and time.monotonic() > started + timeout:
                raise StillRunning(record, timeout)
            time.sleep(poll)
        return record

    def list(self) -> list[JobRecord]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM jobs ORDER BY creation_time DESC").fetchall()
        return [self._reconcile(JobRecord(**dict(row))) for row in rows]

    def _reconcile(self, record: JobRecord) -> JobRecord:
        """A job whose supervisor died without a final status failed.

        Say so instead of 'InProgress'.
        """
        if record.is_terminal or record.supervisor_pid is None:
            return record
        if _pid_alive(record.supervisor_pid):
            return record
        reason = f"the dtrain supervisor (pid {record.supervisor_pid}) exited without finishing"
        self.update(
            record.name,
            status=FAILED,
            secondary_status="Failed",
            message=reason,
            failure_reason=reason,
            end_time=time.time(),
        )
        return self.get(record.name)

    def delete(self, name: str) -> None:
        """Forget a job: its row, status transitions, metrics and hosts, all or none."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM jobs WHERE name = ?", (name,))
            for table in ("transitions", "metrics", "hosts"):
                db.execute(f"DELETE FROM {table} WHERE job = ?", (name,))
            db.execute("COMMIT")

    def transitions(self, name: str) -> builtins.list[Transition]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT status, start_time, message FROM transitions WHERE job = ?"
                " ORDER BY start_time, rowid",
                (name,),
            ).fetchall()
        return [Transition(**dict(row)) for row in rows]

    def add_metrics(self, name: str, samples: Iterable[MetricSample]) -> None:
        """One transaction for the batch: in autocommit each row would be one (20,000 rows took
        3.4 s, in the thread that reads the host's output and heartbeats)."""
        rows = [(name, s.name, s.step, s.value, s.timestamp) for s in samples]
        if rows:
            with self._connect() as db:
                db.execute("BEGIN")
                db.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?)", rows)
                db.execute("COMMIT")

    def set_hosts(self, name: str, hosts: builtins.list[dict[str, Any]]) -> None:
        """The job's hosts as their agents reported them (name, address, interface, ...)."""
        with self._connect() as db:
            db.execute("DELETE FROM hosts WHERE job = ?", (name,))
            db.executemany(
                "INSERT INTO hosts VALUES (?, ?, ?)",
                [(name, i, json.dumps(host, sort_keys=True)) for i, host in enumerate(hosts)],
            )

    def hosts(self, name: str) -> builtins.list[dict[str, Any]]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT facts FROM hosts WHERE job = ? ORDER BY position", (name,)
            ).fetchall()
        return [json.loads(row["facts"]) for row in rows]

    def metrics(self, name: str) -> builtins.list[MetricSample]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT name, value, timestamp, step FROM metrics WHERE job = ?"
                " ORDER BY name, step",
                (name,),
            ).fetchall()
        return [MetricSample(**dict(row)) for row in rows]

    def last_metrics(self, name: str) -> dict[str, float]:
        """Each of the job's metrics' value at its last step, read without their history."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT m.name, m.value FROM metrics AS m JOIN (SELECT name, MAX(step) AS step"
                " FROM metrics WHERE job = ? GROUP BY name) AS last"
                " ON m.name = last.name AND m.step = last.step WHERE m.job = ? ORDER BY m.name",
                (name, name),
            ).fetchall()
        return {row["name"]: row["value"] for row in rows}

    def recent_metrics(self, name: str, count: int) -> builtins.list[MetricSample]:
        """The last ``count`` samples, in step order, of the job's metric logged most often:
        what ``dtrain jobs`` shows of a job (:func:`dtrain.jobs.live.latest`), read without its
        whole history."""
        with self._connect() as db:
            last = db.execute(
                "SELECT name, MAX(step) AS steps FROM metrics WHERE job = ? GROUP BY name"
                " ORDER BY steps DESC, name DESC LIMIT 1",
                (name,),
            ).fetchone()
            if last is None:
                return []
            rows = db.execute(
                "SELECT name, value, timestamp, step FROM metrics WHERE job = ? AND name = ?"
                " ORDER BY step DESC LIMIT ?",
                (name, last["name"], count),
            ).fetchall()
        return [MetricSample(**dict(row)) for row in reversed(rows)]


def spec_dict(record: JobRecord) -> dict[str, Any]:
    return json.loads(record.spec)

"""``dtrain rm`` and ``dtrain prune``: a job's folder and its records go when it is not wanted.

A job folder only grows: every rank's log of every attempt and, under ``hosts/``, each simulated
host's copy of the code and of its share of every channel, its model and its checkpoints.
Removing a job deletes that folder, the job's rows in the store and, unless ``--keep-output``,
its archives under the default output path (``$DTRAIN_HOME/output/<job>``: dtrain's own); what
the job wrote elsewhere stays: the archives under an ``--output-path`` (the user's), a
``--checkpoint-local-path`` folder, and the host folders of agents on other machines
(``join://`` and ``ray://`` clusters).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import DtrainError
from dtrain.jobs.folder import JobFolder, default_output_dir
from dtrain.jobs.store import IN_PROGRESS, JobRecord, JobStore, StillRunning, spec_dict
from dtrain.procfs import running

STOP_WAIT = 60.0
"""Seconds ``rm --force`` waits for a job it stopped to end (ranks get 3 s, then the upload)."""


def folder_size(folder: Path) -> int:
    """Bytes of the files under ``folder``, links not followed."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # a job still writing
                continue
    return total


def mebibytes(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def job_folder(record: JobRecord) -> Path:
    """The job's folder, which must be ``$DTRAIN_HOME/jobs/<name>``: nothing else is removed."""
    folder = JobFolder.for_job(record.name).root
    if Path(record.folder) != folder:
        raise DtrainError(
            f"job {record.name}'s folder is recorded as {record.folder}, not {folder} "
            "(was DTRAIN_HOME moved?); remove it by hand"
        )
    return folder


@dataclass(frozen=True)
class Removal:
    """What removing a job deletes, the bytes that frees, and where its model stays when that
    is not deleted."""

    folders: tuple[Path, ...]
    """Its job folder and, unless kept, its archives under the default output path."""
    size: int
    kept_model: str | None
    """Its ``model.tar.gz``, left in place: under an ``--output-path`` (the user's, never
    deleted) or kept by ``--keep-output``; ``None`` when it made none or it goes too."""


def removal(record: JobRecord, keep_output: bool) -> Removal:
    """What :func:`remove` deletes of ``record``'s job: its folder, and its archives when they
    are under :func:`default_output_dir` (``<job>/output/``) and not ``keep_output``."""
    folders = [job_folder(record)]
    own = spec_dict(record).get("output_path") in (None, default_output_dir().as_uri())
    if own and not keep_output:
        folders.append(default_output_dir() / record.name)
    kept = None if own and not keep_output else record.model_artifacts
    return Removal(tuple(folders), sum(folder_size(folder) for folder in folders), kept)


def remove(store: JobStore, record: JobRecord, keep_output: bool = False) -> Removal:
    """Delete a finished job's folder (and its archives: see :func:`removal`), then its
    records."""
    job_folder(record)  # a folder not where it belongs: refused before waiting
    _await_controller(record)
    planned = removal(record, keep_output)
    for folder in planned.folders:
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise DtrainError(f"could not remove job {record.name}'s {folder}: {error}") from None
    store.delete(record.name)
    return planned


def _await_controller(record: JobRecord) -> None:
    """A job that just ended may still have its controller closing its agents, whose logs are in
    its folder: wait for it to exit. Only then: a process id seen long after may be another's."""
    pid = record.supervisor_pid
    deadline = (record.end_time or 0.0) + STOP_WAIT
    while pid is not None and time.time() < deadline and running(pid):
        time.sleep(0.1)


def removable(store: JobStore, names: Sequence[str], force: bool) -> list[JobRecord]:
    """The jobs of ``names``, every one known and, without ``force``, finished; else an error
    before anything is removed. With ``force``, running jobs are stopped and waited for."""
    records = [store.get(name) for name in dict.fromkeys(names)]  # unknown: did you mean
    running = [record for record in records if not record.is_terminal]
    if running and not force:
        listed = ", ".join(f"{r.name} ({r.status})" for r in running)
        raise DtrainError(
            f"not finished: {listed}; stop it first (dtrain stop NAME), or add --force, "
            "which stops it"
        )
    for record in running:
        if record.status == IN_PROGRESS:
            with contextlib.suppress(DtrainError):  # it ended meanwhile
                store.request_stop(record.name)
    return [_ended(store, record.name) if not record.is_terminal else record for record in records]


def _ended(store: JobStore, name: str) -> JobRecord:
    """A job ``--force`` stopped, once it has ended (``STOP_WAIT`` s at most)."""
    try:
        return store.wait(name, timeout=STOP_WAIT)
    except StillRunning as error:
        raise DtrainError(f"{error}; run dtrain rm again once it has stopped") from None


def prune(
    store: JobStore, older_than: float, dry_run: bool, keep_output: bool = False
) -> Iterator[tuple[JobRecord, Removal]]:
    """Each finished job that ended more than ``older_than`` seconds ago, oldest first, and what
    its removal deleted (or, ``dry_run``, would delete)."""
    cutoff = time.time() - older_than
    found = [
        record
        for record in store.list()
        if record.is_terminal and (record.end_time or record.creation_time) <= cutoff
    ]
    for record in sorted(found, key=lambda record: record.end_time or record.creation_time):
        yield (
            record,
            removal(record, keep_output) if dry_run else remove(store, record, keep_output),
        )

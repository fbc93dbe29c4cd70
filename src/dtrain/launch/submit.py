"""How a job is started: in this process (``dtrain run``), detached (``dtrain run --detach``),
again under a new name (``dtrain rerun``), or for the Estimator.

A job run other than in this process has a controller of its own, ``python -m
dtrain.launch.submit [--detached] FILE``: FILE is a private copy of the spec (mode 0600 in
``DTRAIN_HOME``), deleted once read, so that the job's environment (credentials, often) never
appears in any process's arguments. A detached one runs in a session of its own (no terminal:
Ctrl-C and a closed terminal do not reach it), its output first on a pipe to the submitting
command. Once the job is recorded and its ``logs/`` exists, the controller moves its
output onto ``logs/controller.log`` (:func:`into_job_folder`), which ends the pipe: the submitter
then knows that ``dtrain logs -f``, ``stop`` and ``describe`` find the job, and returns. A
controller that ends before that (the name is taken, the cluster cannot be reached) has said why
on the pipe; the submitter passes it on with its exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import DtrainError
from dtrain.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_STOPPED
from dtrain.jobs.folder import JobFolder, dtrain_home
from dtrain.jobs.spec import JobSpec
from dtrain.jobs.store import JobRecord, JobStore
from dtrain.launch.job import default_job_name, generated_base, prepare, run_job

EXIT_CODES = {"Completed": EXIT_OK, "Failed": EXIT_FAILED, "Stopped": EXIT_STOPPED}


def run_here(
    spec: JobSpec, quiet: bool, on_folder: Callable[[JobFolder], None] | None = None
) -> int:
    """Run ``spec`` in this process to its end, say how it ended, and return the exit status
    of its final status."""
    try:
        record = run_job(spec, console=None if quiet else sys.stdout, on_folder=on_folder)
    except KeyboardInterrupt:
        return EXIT_STOPPED
    if record.failure_reason:
        print(f"dtrain: job {record.name} failed: {record.failure_reason}", file=sys.stderr)
    if record.model_artifacts:
        print(f"dtrain: job {record.name} {record.status}; model: {record.model_artifacts}")
    return EXIT_CODES[record.status]


def spec_command(spec: JobSpec, *options: str) -> list[str]:
    """The command that runs ``spec`` as its job's controller (this module's :func:`main`) on a
    private copy of the spec, which the command deletes once read."""
    handle, path = tempfile.mkstemp(prefix="spec-", suffix=".json", dir=dtrain_home())
    with os.fdopen(handle, "w") as file:
        file.write(spec.to_json())
    return [sys.executable, "-m", "dtrain.launch.submit", *options, path]


def main(argv: Sequence[str] | None = None) -> int:
    """A job's controller, started by :func:`spec_command` (dtrain's own use, not a command)."""
    parser = argparse.ArgumentParser(prog="python -m dtrain.launch.submit")
    parser.add_argument("spec_file", help="a private copy of the spec, deleted once read")
    parser.add_argument(
        "--detached", action="store_true", help="output to the job folder once it exists"
    )
    args = parser.parse_args(argv)
    spec_file = Path(args.spec_file)
    spec = JobSpec.from_json(spec_file.read_text())
    spec_file.unlink()
    try:
        if args.detached:
            return run_here(spec, quiet=True, on_folder=into_job_folder)
        return run_here(spec, quiet=False)
    except DtrainError as error:
        print(f"dtrain: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


@dataclass(frozen=True)
class Detached:
    """What became of a detached submission."""

    started: bool
    """The job is recorded and runs (or already ran) in the background."""
    said: str
    """What its controller printed before it moved its output to the job folder, or ended."""
    status: int | None
    """The controller's exit status, if it ended without recording the job."""


def start_detached(spec: JobSpec) -> Detached:
    """Check ``spec`` (bad input raises here, before anything starts), start its controller in
    the background and return once the job is recorded, or the controller has ended."""
    prepare(spec)
    controller = subprocess.Popen(
        spec_command(spec, "--detached"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert controller.stdout is not None
    try:
        said = controller.stdout.read().decode(errors="replace")
    except KeyboardInterrupt:  # given up before the job was recorded: it must not start
        controller.terminate()
        controller.wait()
        raise
    controller.stdout.close()
    if _recorded_by(spec.job_name, controller.pid):
        return Detached(True, said, None)
    return Detached(False, said, controller.wait())


def _recorded_by(name: str, pid: int) -> bool:
    """The job is recorded, by this controller (not an older job of the same name)."""
    try:
        return JobStore().get(name).supervisor_pid == pid
    except DtrainError:
        return False


def into_job_folder(folder: JobFolder) -> None:
    """Send this process's standard output and error to ``logs/controller.log``: a detached
    controller's tracebacks and warnings stay with its job, and the submitter's pipe ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(folder.controller_log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for stream in (sys.stdout, sys.stderr):
        os.dup2(log, stream.fileno())
    os.close(log)


def rerun_spec(record: JobRecord, job_name: str | None) -> JobSpec:
    """The spec ``record`` ran with (paths made absolute when it was recorded), under
    ``job_name`` or a name generated from the old one's base (``demo-<new time>``)."""
    spec = JobSpec.from_json(record.spec)
    name = job_name or default_job_name(generated_base(record.name))
    return dataclasses.replace(spec, job_name=name, key_salt="")


if __name__ == "__main__":
    sys.exit(main())

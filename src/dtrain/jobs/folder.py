"""Where a job's files live.

The controller's job folder holds the request, every rank's log of every attempt and the hosts'
failure reports; each host's agent lays out an ``/opt/ml``-style tree (code, input, model, output,
checkpoints) under its own ``DTRAIN_HOME``, which for the hosts of a local job is the same.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import DtrainError
from dtrain.topology import host_name

JOB_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")


def dtrain_home() -> Path:
    """``$DTRAIN_HOME`` (default ``~/.dtrain``), private: job folders hold data, logs and the
    jobs' environment (credentials, often).

    A missing one is created, mode 0700. An existing one is used only if it is already private
    (this user's, no access for group or others): its mode is never changed, since a folder
    dtrain did not create may be shared on purpose (``/tmp``, a project's folder).
    """
    home = Path(os.environ.get("DTRAIN_HOME") or Path.home() / ".dtrain").expanduser()
    if not home.is_dir():
        make_private_dirs(home)
    info = home.stat()
    mode = stat.S_IMODE(info.st_mode)
    fix = "point DTRAIN_HOME at a path that does not exist yet (dtrain creates it, mode 0700)"
    if info.st_uid != os.geteuid():
        problem = f"belongs to another user (uid {info.st_uid})"
    elif mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"can be written by its group or others (mode {mode:04o}): a shared folder"
    elif mode & (stat.S_IRWXG | stat.S_IRWXO):
        problem = f"can be read by its group or others (mode {mode:04o})"
        fix = f"chmod 700 it, or {fix}"
    else:
        return home
    raise DtrainError(
        f"DTRAIN_HOME {home} {problem}; dtrain keeps jobs' data, logs and environment in a "
        f"folder of this user's alone, and never changes the mode of one it did not create: {fix}"
    )


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents readable by their owner only (mode 0700); an
    existing ``path`` must be this user's and writable by nobody else.

    Checkpoints and model archives may land outside ``DTRAIN_HOME``; what dtrain creates for them
    must not be readable by every user of the machine, whatever the umask, and a folder others
    can write lets them replace what the job reads back (a checkpoint it resumes from).
    """
    missing = []
    existing = path
    while not existing.exists():
        missing.append(existing)
        existing = existing.parent
    if not missing:
        check_own_folder(path)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile: another process of the job's, or someone else
            check_own_folder(folder)
        else:
            folder.chmod(0o700)  # whatever the umask; never a folder dtrain did not create


def check_own_folder(path: Path) -> None:
    """Refuse a folder of another user, or one that group or others may write."""
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise DtrainError(f"{path} is not a folder")
    if info.st_uid != os.geteuid():
        raise DtrainError(
            f"{path} belongs to another user (uid {info.st_uid}): a job writes and reads back "
            "its files only in folders of its own user"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DtrainError(
            f"{path} can be written by its group or others (mode "
            f"{stat.S_IMODE(info.st_mode):04o}), who could replace what the job reads back: "
            f"chmod go-w {path}, or choose a folder of your own"
        )


def create_private_file(path: Path) -> None:
    """Create ``path`` readable by its owner only (mode 0600) before anything is written to it,
    or make it so: it holds the job's environment (credentials, often)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    path.chmod(0o600)


@dataclass(frozen=True)
class HostFolder:
    """One host's ``/opt/ml``."""

    root: Path

    @property
    def code_dir(self) -> Path:
        """The job's code, as SageMaker's ``/opt/ml/code``: every rank's working directory."""
        return self.root / "code"

    @property
    def input_dir(self) -> Path:
        return self.root / "input"

    @property
    def input_config_dir(self) -> Path:
        return self.root / "input" / "config"

    def channel_dir(self, channel: str) -> Path:
        return self.root / "input" / "data" / channel

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def output_dir(self) -> Path:
        return self.root / "output"

    @property
    def output_data_dir(self) -> Path:
        return self.root / "output" / "data"

    @property
    def output_intermediate_dir(self) -> Path:
        return self.root / "output" / "intermediate"

    @property
    def failure_file(self) -> Path:
        return self.root / "output" / "failure"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def create(self) -> None:
        for path in (
            self.input_config_dir,
            self.root / "input" / "data",
            self.model_dir,
            self.output_data_dir,
            self.output_intermediate_dir,
            self.checkpoints_dir,
        ):
            make_private_dirs(path)


def host_folder(home: Path, job_name: str, host: str) -> HostFolder:
    """Where an agent whose ``DTRAIN_HOME`` is ``home`` lays out ``host`` of the job."""
    return HostFolder(home / "jobs" / job_name / "hosts" / host)


@dataclass(frozen=True)
class JobFolder:
    """``$DTRAIN_HOME/jobs/<name>`` on the controller's machine.

    Holds ``spec.json``, ``logs/attempt-<k>/rank<R>.log``, ``logs/controller.log``,
    ``logs/agent-<host>.log`` (agents the controller started) and ``hosts/algo-<i>/`` (there, or
    on each host's own machine).
    """

    root: Path

    @classmethod
    def for_job(cls, job_name: str) -> JobFolder:
        return cls(dtrain_home() / "jobs" / job_name)

    @property
    def spec_file(self) -> Path:
        return self.root / "spec.json"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    def attempt_logs_dir(self, attempt: int) -> Path:
        return self.logs_dir / f"attempt-{attempt}"

    def log_file(self, rank: int, attempt: int) -> Path:
        return self.attempt_logs_dir(attempt) / f"rank{rank}.log"

    @property
    def controller_log_file(self) -> Path:
        """What the controller said: statuses, hosts joining, refused connections."""
        return self.logs_dir / "controller.log"

    @property
    def tensorboard_dir(self) -> Path:
        """TensorBoard runs: ``metrics/`` and each host's (:mod:`dtrain.jobs.tensorboard`)."""
        return self.root / "tensorboard"

    def agent_log_file(self, host: str) -> Path:
        return self.logs_dir / f"agent-{host}.log"

    def host(self, host_index: int) -> HostFolder:
        return HostFolder(self.root / "hosts" / host_name(host_index))

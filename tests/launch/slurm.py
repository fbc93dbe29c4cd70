"""A one-node Slurm cluster (Debian's ``slurmctld``, ``slurmd`` and ``munged``) that a test owns.

Everything lives in a folder the test gives (configuration, state, spool, logs, munge's key and
socket) and runs inside a network namespace of its own, which also holds the job's processes:
``hostname -I`` there names only the namespace's address, ports are private to it, and ending
the cluster ends every process in the namespace, by pid. Needs root (``slurmd`` launches jobs
as their user; ``munged`` runs as root only when forced) and ``nsenter``; ``missing`` says what
is not here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun", "nsenter")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
"""Job states after which a job's processes are gone."""


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd and munged)"
    absent = [program for program in PROGRAMS if shutil.which(program) is None]
    if absent:
        return f"not installed: {', '.join(absent)} (apt-get install slurmctld slurmd munge)"
    return None


class Slurm:
    """The cluster's one node, named as this machine (slurmctld insists), at ``address``."""

    def __init__(self, namespace: str, address: str, folder: Path) -> None:
        self.namespace = namespace
        self.address = address
        self.folder = folder
        self.node = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
        self.daemons: list[subprocess.Popen[bytes]] = []

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` inside the namespace (``nsenter``, not ``ip netns exec``: that one mounts a
        fresh /sys without the cgroup folders slurmd reads)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace}", *argv]

    def run(self, *argv: str, env: Mapping[str, str] | None = None) -> str:
        result = subprocess.run(
            self.command(argv), env=dict(env or self.env), capture_output=True, text=True,
            timeout=30, check=True,
        )  # fmt: skip
        return result.stdout

    def submit(
        self, script: Path, *args: str, env: Mapping[str, str], options: Sequence[str]
    ) -> str:
        """Submit ``script`` with ``args`` (``sbatch``, the job's environment ``env``); its id."""
        output = self.folder / "job-%j.out"
        submitted = self.run(
            "sbatch", "--parsable", f"--output={output}", *options, str(script), *args,
            env={**env, "SLURM_CONF": self.env["SLURM_CONF"]},
        )  # fmt: skip
        return submitted.strip().split(";")[0]

    def wait(self, job: str, timeout: float) -> tuple[str, str, str]:
        """The job's final state (``COMPLETED``, ``FAILED``, ...), exit code (``status:signal``)
        and output, once it ended (polled: ``sbatch --wait`` polls at growing intervals, up to
        20 s late here)."""
        deadline = time.monotonic() + timeout
        while True:
            fields = dict(
                field.split("=", 1)
                for field in self.run("scontrol", "-o", "show", "job", job).split()
                if "=" in field
            )
            if fields["JobState"] in ENDED:
                return fields["JobState"], fields["ExitCode"], self.output(job)
            if time.monotonic() > deadline:
                self.run("scancel", job)
                late = f"job {job} still {fields['JobState']} after {timeout:.0f} s"
                raise AssertionError(f"{late}:\n{self.output(job)[-3000:]}")
            time.sleep(0.2)

    def wait_for_no_job_processes(self, timeout: float) -> None:
        """Until nothing of a job runs: Slurm reports a cancelled job CANCELLED at once, while
        its steps still end (SIGTERM, then SIGKILL after ``KillWait``)."""
        self._until(lambda: self.job_processes() == [], "the job's processes to end", timeout)

    def wait_for(self, job: str, text: str, timeout: float) -> None:
        """Until the job's output shows ``text``."""
        self._until(lambda: text in self.output(job), f"job {job} to print {text!r}", timeout)

    def job_processes(self) -> list[str]:
        """What runs in the namespace besides the daemons (``slurmctld``'s ``slurmscriptd``)."""
        daemons = {str(daemon.pid) for daemon in self.daemons}
        running = []
        for pid in self._pids():
            with contextlib.suppress(FileNotFoundError):
                status = Path(f"/proc/{pid}/status").read_text()
                fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
                if str(pid) not in daemons and fields["PPid"].strip() not in daemons:
                    running.append(f"{pid} {fields['Name'].strip()}")
        return running

    def output(self, job: str) -> str:
        with contextlib.suppress(FileNotFoundError):
            return (self.folder / f"job-{job}.out").read_text()
        return ""

    def configure(self) -> None:
        folder = self.folder
        for name in ("state", "spool", "log", "munge"):
            (folder / name).mkdir(mode=0o700)
        key = folder / "munge" / "key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        settings = {
            "ClusterName": "dtraintest",
            "SlurmctldHost": f"{self.node}({self.address})",
            "SlurmUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={folder / 'munge' / 'socket'}",
            "StateSaveLocation": folder / "state",
            "SlurmdSpoolDir": folder / "spool",
            "SlurmctldPidFile": folder / "slurmctld.pid",
            "SlurmdPidFile": folder / "slurmd.pid",
            "SlurmctldLogFile": folder / "log" / "slurmctld.log",
            "SlurmdLogFile": folder / "log" / "slurmd.log",
            "MailProg": shutil.which("true"),
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "MpiDefault": "none",
            "ReturnToService": "2",
            "KillWait": "5",
            "SlurmdParameters": "config_overrides",  # two CPUs, so two tasks, on any machine
            "NodeName": f"{self.node} NodeAddr={self.address} CPUs=2",
            "PartitionName": "test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        }
        text = "".join(f"{name}={value}\n" for name, value in settings.items())
        (folder / "slurm.conf").write_text(text)

    def start(self) -> None:
        """The daemons, in the foreground (``nsenter`` execs each: the pid is the daemon's),
        once the node takes jobs."""
        munge = self.folder / "munge"
        daemons = [
            ["munged", "--foreground", "--force", f"--socket={munge / 'socket'}",
             f"--key-file={munge / 'key'}", f"--pid-file={munge / 'pid'}",
             f"--log-file={munge / 'log'}", f"--seed-file={munge / 'seed'}"],
            ["slurmctld", "-D", "-i", "-f", self.env["SLURM_CONF"]],
            ["slurmd", "-D", "-f", self.env["SLURM_CONF"], "-N", self.node],
        ]  # fmt: skip
        for argv in daemons:
            log = (self.folder / "log" / f"{argv[0]}.out").open("w")
            self.daemons.append(
                subprocess.Popen(self.command(argv), env=self.env, stdout=log, stderr=log)
            )
            if argv[0] == "munged":
                self._until(lambda: (munge / "socket").exists(), "munged to listen")
        self._until(
            lambda: self.run("sinfo", "-h", "-o", "%T").strip() == "idle", "the node to be idle"
        )

    def stop(self) -> None:
        """End every process in the namespace (daemons, job steps, the job's own), by pid."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + 5
            while pids := self._pids():
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        for daemon in self.daemons:
            daemon.wait(timeout=10)

    def _pids(self) -> list[int]:
        listed = subprocess.run(
            ["ip", "netns", "pids", self.namespace], capture_output=True, text=True, timeout=10
        )
        return [int(pid) for pid in listed.stdout.split()]

    def _until(self, ready: Callable[[], bool], what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {log.name}\n{log.read_text()[-1500:]}"
                    for log in sorted((self.folder / "log").iterdir())
                )
                raise AssertionError(f"Slurm: waited {timeout:.0f} s for {what}\n{logs}")
            time.sleep(0.1)


@contextlib.contextmanager
def cluster(namespace: str, address: str, folder: Path) -> Iterator[Slurm]:
    """A started one-node cluster in ``namespace`` at ``address``; every process in the
    namespace ended afterwards."""
    slurm = Slurm(namespace, address, folder)
    slurm.configure()
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()

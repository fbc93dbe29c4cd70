"""Whole jobs run in this process against a fake agent over loopback: a host that never sends a
folder it is asked for is ended by ``--max-run`` and ``dtrain stop``, and what an agent tells (its
hostname, its ranks' output and tails) reaches the console, ``controller.log`` and the rank logs
escaped."""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dtrain.jobs.folder import JobFolder
from dtrain.jobs.spec import JobSpec
from dtrain.jobs.store import FAILED, STOPPED, JobRecord, JobStore
from dtrain.launch import controller as controller_module
from dtrain.launch.job import run_job
from dtrain.launch.transfer import send_folder
from dtrain.launch.wire import ConnectionClosed, Message
from tests.launch.peers import FakeAgent

pytestmark = pytest.mark.timeout(60)
SECRET = b"s" * 64


@dataclass
class FakeJob:
    store: JobStore
    console: io.StringIO
    agent: FakeAgent
    thread: threading.Thread
    records: list[JobRecord]

    def end(self, timeout: float = 20) -> JobRecord:
        self.thread.join(timeout)
        assert self.records, f"the job did not end within {timeout:g} s"
        return self.records[0]


def obliging(
    lines: list[str] | None = None, code: int = 0, tail: str = "", sends: bool = True
) -> Any:
    """An agent that lays out, opens the store and runs each rank to ``code`` at once, after
    ``lines`` of output; it sends the folders asked for only if it ``sends``."""

    def script(agent: FakeAgent, message: Message) -> None:
        if message.kind == "end":  # of the code stream
            agent.connection.send("prepared")
        elif message.kind == "open_store":
            agent.connection.send("store", attempt=message["attempt"], port=1234)
        elif message.kind == "start":
            attempt = message["attempt"]
            for rank in sorted(int(rank) for rank in message["ranks"]):
                stamped = [[time.time(), line] for line in lines or []]
                agent.connection.send(
                    "output", attempt=attempt, rank=rank, lines=stamped, frame=None
                )
                agent.exited(attempt, rank, code if rank == 0 else 0, tail)
            agent.connection.send("done", attempt=attempt)
        elif message.kind == "send" and sends:
            send_folder(agent.connection, message["stream"], Path("/nonexistent"))

    return script


@pytest.fixture
def fake_job(dtrain_home: Path, tmp_path: Path) -> Iterator[Any]:
    started: list[FakeJob] = []

    def start(script: Any, told: dict[str, Any] | None = None, **spec: Any) -> FakeJob:
        source = tmp_path / "source"
        source.mkdir(exist_ok=True)
        (source / "train.py").write_text("")
        secret = tmp_path / "secret"
        secret.write_bytes(SECRET)
        secret.chmod(0o600)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        job_spec = JobSpec(
            "train.py", "fake", instance_type="local_cpu", source_dir=str(source),
            cluster=f"join://127.0.0.1:{port}", secret_file=str(secret), join_timeout=30, **spec,
        )  # fmt: skip
        store, console, records = JobStore(), io.StringIO(), []
        thread = threading.Thread(
            target=lambda: records.append(run_job(job_spec, store, console)), daemon=True
        )
        thread.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                agent = FakeAgent(port, "algo-1", script, dtrain_home, SECRET, **(told or {}))
                break
            except (OSError, ConnectionClosed):
                assert time.monotonic() < deadline, "the controller never listened"
                time.sleep(0.05)
        job = FakeJob(store, console, agent, thread, records)
        started.append(job)
        return job

    yield start
    for job in started:
        if job.thread.is_alive():
            job.store.request_stop("fake")
            job.thread.join(30)


def test_max_run_ends_a_job_whose_host_never_sends_its_folders(fake_job: Any) -> None:
    job = fake_job(obliging(sends=False), max_run=1)
    record = job.end()
    assert (record.status, record.secondary_status) == (STOPPED, "MaxRuntimeExceeded")
    assert "send" in job.agent.orders  # it was asked, in the TensorBoard collection


def test_dtrain_stop_ends_a_job_whose_host_never_sends_its_folders(fake_job: Any) -> None:
    job = fake_job(obliging(sends=False))
    deadline = time.monotonic() + 20
    while "send" not in job.agent.orders:  # the controller waits for its TensorBoard events
        assert time.monotonic() < deadline
        time.sleep(0.05)
    job.store.request_stop("fake")
    record = job.end()
    assert record.status == STOPPED and record.model_artifacts is None
    assert "Stopped: Stopped by request (dtrain stop)" in job.console.getvalue()
    assert job.agent.orders.count("send") == 1  # no upload after the stop


def test_what_an_agent_tells_is_shown_escaped_everywhere(fake_job: Any) -> None:
    forged = "[dtrain fake 00:00:09] Completed: Training job completed"
    job = fake_job(
        obliging(
            lines=[f"loss 1\n{forged}", "\x1b[2Jcleared"],
            code=1,
            tail="Traceback (most recent call last):\nValueError: bad\x1b[31m red",
        ),
        told={"hostname": "box\n[dtrain fake 00:00:01] \x1b[31m", "cpus": 1},
        processes_per_host=2,
    )
    record = job.end()
    assert record.status == FAILED
    assert (
        record.failure_reason == "rank 0 (algo-1) exited with code 1: ValueError: bad\\x1b[31m red"
    )
    folder = JobFolder.for_job("fake")
    console = job.console.getvalue()
    journal = folder.controller_log_file.read_text()
    rank_log = (folder.logs_dir / "attempt-1" / "rank0.log").read_text()
    for shown in (console, journal, rank_log):
        assert "\x1b" not in shown
        assert "\n[dtrain fake 00:00:09]" not in shown  # no forged line
    assert "2 processes on the 1 cores of box\\n[dtrain fake 00:00:01] \\x1b[31m (algo-1)" in (
        journal
    )
    assert f"[algo-1,0]: loss 1\\n{forged}\n" in console
    assert len(rank_log.splitlines()) == 2
    assert "ValueError: bad\\x1b[31m red" in (folder.host(0).failure_file.read_text())


def test_a_host_that_never_sends_its_folders_fails_the_upload_naming_it(
    fake_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controller_module, "SILENCE_LIMIT", 0.5)
    job = fake_job(obliging(sends=False))
    record = job.end()
    assert record.status == FAILED
    assert record.failure_reason == "cannot collect model/ from algo-1: its agent sent nothing " + (
        "of it for 0.5 s"
    )
    said = job.console.getvalue()
    assert "TensorBoard events not collected: cannot collect tensorboard/ from algo-1: its " in said

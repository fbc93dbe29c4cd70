"""The job store: statuses, transitions, metrics, and several writers at once."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from dtrain.errors import DtrainError
from dtrain.jobs.metrics import MetricSample
from dtrain.jobs.store import JobStore, StillRunning


def _writer(path: str, name: str, count: int) -> None:
    store = JobStore(Path(path))
    store.create(name, "{}", Path("/tmp") / name)
    for step in range(count):
        store.add_metrics(name, [MetricSample("loss", float(step), 0.0, step)])
        store.update(name, secondary_status="Training", message=f"step {step}")


def test_concurrent_writers(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    JobStore(path)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(str(path), f"job-{i}", 40)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    store = JobStore(path)
    assert sorted(r.name for r in store.list()) == [f"job-{i}" for i in range(4)]
    for i in range(4):
        assert [s.value for s in store.metrics(f"job-{i}")] == [float(s) for s in range(40)]
        assert len(store.transitions(f"job-{i}")) == 41


def test_the_store_is_private_from_the_start(tmp_path: Path) -> None:
    previous = os.umask(0)  # whatever the umask: the file holds every job's environment
    try:
        JobStore(tmp_path / "jobs.db").create("j", "{}", tmp_path)
    finally:
        os.umask(previous)
    assert (tmp_path / "jobs.db").stat().st_mode & 0o777 == 0o600


def test_duplicate_name_and_unknown_job(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.db")
    store.create("train-a", "{}", tmp_path)
    with pytest.raises(DtrainError, match="already used"):
        store.create("train-a", "{}", tmp_path)
    with pytest.raises(DtrainError, match="did you mean 'train-a'"):
        store.get("train-b")


def test_stop_request_and_terminal_jobs(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.db")
    store.create("j", "{}", tmp_path)
    assert store.request_stop("j").status == "Stopping"
    store.update("j", status="Stopped", secondary_status="Stopped")
    with pytest.raises(DtrainError, match="already Stopped"):
        store.request_stop("j")


def test_wait_returns_the_record_the_job_ended_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JobStore(tmp_path / "jobs.db")
    store.create("j", "{}", tmp_path)
    polls: list[float] = []

    def poll(seconds: float) -> None:  # the job ends while the second poll waits
        polls.append(seconds)
        if len(polls) == 2:
            store.update("j", status="Stopped", secondary_status="Stopped")

    monkeypatch.setattr("dtrain.jobs.store.time.sleep", poll)
    record = store.wait("j", poll=0.5)
    assert (record.name, record.status, polls) == ("j", "Stopped", [0.5, 0.5])
    assert store.wait("j", timeout=0) == record  # an ended job: at once, whatever the timeout


def test_wait_gives_up_after_its_timeout(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.db")
    store.create("j", "{}", tmp_path)
    store.request_stop("j")
    with pytest.raises(StillRunning, match=r"^job j is still Stopping after 0.05 s$") as caught:
        store.wait("j", timeout=0.05, poll=0.01)
    assert caught.value.record.status == "Stopping" and caught.value.waited == 0.05
    with pytest.raises(DtrainError, match="no job named 'k'"):
        store.wait("k")


def test_job_with_dead_supervisor_is_marked_failed(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.db")
    store.create("orphan", "{}", tmp_path)
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    store.update("orphan", supervisor_pid=child)
    record = store.get("orphan")
    assert record.status == "Failed"
    assert f"pid {child}" in (record.failure_reason or "")


def test_last_metrics_are_each_metrics_value_at_its_last_step(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.db")
    for job in ("a", "b"):
        store.create(job, "{}", tmp_path / job)
    samples = [MetricSample("loss", 1.0 / (s + 1), 10.0 + s, s) for s in (2, 0, 1)]
    store.add_metrics("a", [*samples, MetricSample("accuracy", 0.5, 11.0, 0)])
    store.add_metrics("b", [MetricSample("loss", 9.0, 20.0, 7)])
    assert store.last_metrics("a") == {"accuracy": 0.5, "loss": pytest.approx(1 / 3)}
    assert store.last_metrics("b") == {"loss": 9.0}
    store.create("c", "{}", tmp_path / "c")
    assert store.last_metrics("c") == {}

"""TensorBoard: a job's metrics and its ranks' own events, read back with TensorBoard's reader.

One job (2 hosts x 1 process) serves every assertion about what a job writes.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dtrain.errors import ConfigError
from dtrain.estimator import PyTorch, TensorBoardOutputConfig
from dtrain.jobs.metrics import MetricSample
from dtrain.jobs.spec import JobSpec
from dtrain.jobs.tensorboard import MetricEvents, local_path
from tests.conftest import JOB_SCRIPTS, dtrain

LOSSES = [1.0, 0.5, 0.3333, 0.25]
DEFINITIONS = json.dumps([{"Name": "train:loss", "Regex": "loss=([0-9.]+)"}])


@dataclass(frozen=True)
class Job:
    home: Path
    name: str
    folder: Path
    published: Path
    console: str
    """What ``dtrain run`` printed to a pipe (standard output and error)."""


def _scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``tag`` in the run at ``folder``, as TensorBoard reads it."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    home = tmp_path_factory.mktemp("home")
    published = tmp_path_factory.mktemp("tensorboard-out")
    data = tmp_path_factory.mktemp("data")
    (data / "part-0.csv").write_text("1,2\n")
    result = dtrain(
        "run",
        "tensorboard_writer.py",
        "--source-dir",
        str(JOB_SCRIPTS),
        "--instance-count",
        "2",
        "--processes-per-host",
        "1",
        "--instance-type",
        "local_cpu",
        "--job-name",
        "tb",
        "--metric-definitions",
        DEFINITIONS,
        "--tensorboard-output-path",
        str(published),
        "--channel",
        f"train={data}",
        home=home,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return Job(home, "tb", home / "jobs" / "tb", published, result.stdout + result.stderr)


def test_metric_definitions_become_scalars(job: Job) -> None:
    found = _scalars(job.folder / "tensorboard" / "metrics", "train:loss")
    assert [step for step, _ in found] == [0, 1, 2, 3]
    assert [value for _, value in found] == pytest.approx(LOSSES)


def test_each_hosts_rank_events_are_collected_in_its_folder(job: Job) -> None:
    for host, rank in (("algo-1", 0), ("algo-2", 1)):
        found = _scalars(job.folder / "tensorboard" / host / f"rank{rank}", "rank/value")
        assert found == [(step, 10 * rank + step) for step in range(4)]


def test_events_are_copied_to_the_output_path(job: Job) -> None:
    copy = job.published / job.name / "tensorboard-output"
    assert _scalars(copy / "metrics", "train:loss") == _scalars(
        job.folder / "tensorboard" / "metrics", "train:loss"
    )
    assert _scalars(copy / "algo-2" / "rank1", "rank/value")[-1] == (3, 13.0)
    described = json.loads(dtrain("describe", job.name, home=job.home).stdout)
    assert described["TensorBoardOutputConfig"] == {"S3OutputPath": str(job.published)}


def test_a_pipe_gets_no_progress_bars_or_status_lines(job: Job) -> None:
    assert "\r" not in job.console
    assert "tar.gz:" not in job.console
    agent_log = (job.folder / "logs" / "agent-algo-1.log").read_text()
    assert "channel train" not in agent_log and "\r" not in agent_log
    assert "[algo-1,0]: loss=1.0000" in job.console  # the console itself is there
    lines = [line for line in job.console.splitlines() if line.startswith("[dtrain tb ")]
    assert not [line for line in lines if "] Training: " in line and "attempt" not in line]


def test_metrics_as_csv_and_json(job: Job) -> None:
    as_csv = dtrain("metrics", job.name, "--format", "csv", home=job.home)
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [(row["metric"], int(row["step"]), float(row["value"])) for row in rows] == [
        ("train:loss", step, value) for step, value in enumerate(LOSSES)
    ]
    as_json = json.loads(dtrain("metrics", job.name, "--format", "json", home=job.home).stdout)
    assert [(s["step"], s["value"]) for s in as_json] == list(enumerate(LOSSES))
    assert all(isinstance(s["timestamp"], float) for s in as_json)
    table = dtrain("metrics", job.name, home=job.home).stdout.splitlines()
    assert table[0].split() == ["METRIC", "STEP", "VALUE"]
    assert table[1].split() == ["train:loss", "0", "1"]


def test_a_bad_format_is_refused_with_a_suggestion(job: Job) -> None:
    result = dtrain("metrics", job.name, "--format", "cvs", home=job.home)
    assert result.returncode == 2
    assert "--format" in result.stderr and "did you mean 'csv'" in result.stderr


def test_a_local_path_outside_opt_ml_is_refused_before_launch(tmp_path: Path) -> None:
    result = dtrain(
        "run",
        "tensorboard_writer.py",
        "--source-dir",
        str(JOB_SCRIPTS),
        "--tensorboard-local-path",
        "/tmp/tb",
        home=tmp_path,
    )
    assert result.returncode == 2
    assert "LocalPath" in result.stderr and "/opt/ml/output/tensorboard" in result.stderr
    assert not (tmp_path / "jobs").exists()


def test_local_path_maps_onto_the_host_folder() -> None:
    assert str(local_path(None)) == "output/tensorboard"
    assert str(local_path({"LocalPath": "/opt/ml/output/tb/"})) == "output/tb"
    with pytest.raises(ConfigError, match="inside /opt/ml"):
        local_path({"LocalPath": "/opt/ml/../etc"})


def test_metric_events_keep_steps_and_wall_times(tmp_path: Path) -> None:
    events = MetricEvents(tmp_path / "metrics")
    events.add([])
    assert not (tmp_path / "metrics").exists()  # no file for a job without metrics
    events.add([MetricSample("acc", 0.5, 1000.0, 0), MetricSample("acc", 0.75, 1001.5, 1)])
    events.close()
    reader = EventAccumulator(str(tmp_path / "metrics"))
    reader.Reload()
    found = [(e.wall_time, e.step, e.value) for e in reader.Scalars("acc")]
    assert found == [(1000.0, 0, 0.5), (1001.5, 1, 0.75)]


def test_rerun_specs_keep_the_output_path_absolute(tmp_path: Path) -> None:
    local = JobSpec("t.py", "tb", tensorboard_output_config={"S3OutputPath": "out/tb"})
    assert local.with_absolute_paths().tensorboard_output_config == {
        "S3OutputPath": str(Path("out/tb").resolve())
    }
    remote = {"S3OutputPath": "s3://bucket/tb", "LocalPath": "/opt/ml/tb"}
    spec = JobSpec("t.py", "tb", tensorboard_output_config=remote)
    assert spec.with_absolute_paths().tensorboard_output_config == remote


def test_estimator_passes_the_sdk_config_on() -> None:
    config = TensorBoardOutputConfig("s3://bucket/tb", container_local_output_path="/opt/ml/tb")
    estimator = PyTorch("train.py", tensorboard_output_config=config)
    spec = estimator._spec(None, "tb-estimator")
    assert spec.tensorboard_output_config == {
        "S3OutputPath": "s3://bucket/tb",
        "LocalPath": "/opt/ml/tb",
    }
    as_dict = PyTorch("train.py", tensorboard_output_config={"S3OutputPath": "out/tb"})
    assert as_dict._spec(None, "tb-dict").tensorboard_output_config == {"S3OutputPath": "out/tb"}
    with pytest.raises(ConfigError, match="tensorboard_output_config"):
        PyTorch("train.py", tensorboard_output_config="s3://bucket/tb")

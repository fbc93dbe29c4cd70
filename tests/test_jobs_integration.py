"""Real multi-process jobs through the CLI: success, failures, limits, stop, and no leftovers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import JOB_SCRIPTS, S3_KEYS, dtrain, processes_of_job

pytestmark = pytest.mark.timeout(240)


def describe(home: Path, name: str) -> dict:
    result = dtrain("describe", name, home=home)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def run_script(
    home: Path,
    script: str,
    name: str,
    *flags: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
):
    return dtrain(
        "run", script, "--source-dir", str(JOB_SCRIPTS), "--job-name", name,
        "--instance-type", "local_cpu", *flags, home=home, timeout=timeout, env=env,
    )  # fmt: skip


def test_good_job_two_hosts_two_processes(dtrain_home: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"part-{i}.txt").write_text(str(i))
    result = run_script(
        dtrain_home, "collective.py", "good",
        "--instance-count", "2", "--processes-per-host", "2",
        "--hyperparameters", '{"epochs": 2, "lr": 0.1, "opt": {"b": 1, "a": "x"}, "v": true}',
        "--channel", f"training={data}",
        "--metric-definitions", '[{"Name": "loss", "Regex": "loss=([0-9.]+)"}]',
        "--environment", "MY_FLAG=on",
        "--checkpoint-local-path", str(tmp_path / "checkpoints"),
        env={"LAUNCHER_SETTING": "inherited"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[algo-2,3]: step=2 loss=103.0000" in result.stdout
    assert re.search(r"^\[dtrain good \d\d:\d\d:\d\d\] Completed", result.stdout, re.M)

    info = describe(dtrain_home, "good")
    assert info["TrainingJobStatus"] == "Completed"
    assert info["SecondaryStatus"] == "Completed"
    assert info["HyperParameters"]["epochs"] == "2"
    assert [t["Status"] for t in info["SecondaryStatusTransitions"]] == [
        "Starting", "Downloading", "Training", "Uploading", "Completed",
    ]  # fmt: skip
    assert [m["MetricName"] for m in info["FinalMetricDataList"]] == ["loss"]
    assert info["FinalMetricDataList"][0]["Value"] == pytest.approx(0.3333)  # rank 0's only
    assert info["ResourceConfig"] == {
        "InstanceType": "local_cpu", "InstanceCount": 2, "ProcessesPerHost": 2,
    }  # fmt: skip
    assert info["OutputDataConfig"]["S3OutputPath"] == (dtrain_home / "output").as_uri()
    assert info["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == str(data)
    start = datetime.fromisoformat(info["TrainingStartTime"])
    assert start <= datetime.fromisoformat(info["TrainingEndTime"])

    artifact = Path(info["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("file://"))
    with tarfile.open(artifact) as tar:
        assert tar.getnames() == ["weights.txt"]

    job_dir = Path(info["JobFolder"])
    reports = {
        rank: json.loads(
            (
                job_dir / "hosts" / f"algo-{rank // 2 + 1}" / "output" / "data"
                / f"report-rank{rank}.json"
            ).read_text()
        )
        for rank in range(4)
    }  # fmt: skip
    env3 = reports[3]["env"]
    assert reports[3]["argv"] == [
        "--epochs", "2", "--lr", "0.1", "--opt", "a=x,b=1", "-v", "True",
    ]  # fmt: skip
    assert env3["RANK"] == "3" and env3["WORLD_SIZE"] == "4"
    assert env3["LOCAL_RANK"] == "1" and env3["LOCAL_WORLD_SIZE"] == "2"
    assert env3["OMPI_COMM_WORLD_RANK"] == "3" and env3["OMPI_COMM_WORLD_LOCAL_RANK"] == "1"
    assert env3["OMPI_COMM_WORLD_SIZE"] == "4"
    assert env3["MASTER_ADDR"] == "127.0.0.1"
    assert {r["env"]["MASTER_PORT"] for r in reports.values()} == {env3["MASTER_PORT"]}
    assert 0 < int(env3["MASTER_PORT"]) < 65536
    assert env3["MY_FLAG"] == "on" and env3["LAUNCHER_SETTING"] == "inherited"
    assert env3["DTRAIN_CHECKPOINT_DIR"] == str(tmp_path / "checkpoints")
    assert (tmp_path / "checkpoints").is_dir()
    assert env3["SM_CURRENT_HOST"] == "algo-2"
    assert json.loads(env3["SM_HOSTS"]) == ["algo-1", "algo-2"]
    assert json.loads(env3["SM_CHANNELS"]) == ["training"]
    assert env3["SM_CHANNEL_TRAINING"].endswith("hosts/algo-2/input/data/training")
    assert env3["SM_HP_EPOCHS"] == "2" and env3["SM_HP_OPT"] == '{"a":"x","b":1}'
    assert json.loads(env3["SM_HPS"]) == {
        "epochs": 2,
        "lr": 0.1,
        "opt": {"a": "x", "b": 1},
        "v": True,
    }
    assert json.loads(env3["SM_USER_ARGS"]) == reports[3]["argv"]
    training_env = json.loads(env3["SM_TRAINING_ENV"])
    assert training_env["current_host"] == "algo-2" and training_env["job_name"] == "good"
    assert env3["SM_NUM_GPUS"] == "0" and int(env3["SM_NUM_CPUS"]) >= 1
    assert Path(reports[3]["cwd"]) == job_dir / "hosts" / "algo-2" / "code"
    host2 = job_dir / "hosts" / "algo-2"
    assert env3["SM_OUTPUT_DIR"] == str(host2 / "output")
    assert env3["SM_INPUT_DIR"] == str(host2 / "input")
    assert env3["SM_INPUT_CONFIG_DIR"] == str(host2 / "input" / "config")
    data_config = json.loads((host2 / "input/config/inputdataconfig.json").read_text())
    assert data_config["training"]["S3DistributionType"] == "FullyReplicated"
    resource = json.loads((host2 / "input/config/resourceconfig.json").read_text())
    assert resource["current_host"] == "algo-2" and resource["hosts"] == ["algo-1", "algo-2"]
    hps = json.loads((host2 / "input/config/hyperparameters.json").read_text())
    assert hps["opt"] == '{"b": 1, "a": "x"}'
    assert sorted(p.name for p in (host2 / "input/data/training").iterdir()) == [
        f"part-{i}.txt" for i in range(4)
    ]
    assert (dtrain_home.stat().st_mode & 0o777) == 0o700
    assert processes_of_job("good") == []

    logs = dtrain("logs", "good", "--rank", "2", home=dtrain_home)
    assert logs.returncode == 0 and "step=0 loss=102.0000" in logs.stdout
    interleaved = dtrain("logs", "good", "--timestamps", home=dtrain_home).stdout.splitlines()
    stamps = [line.split(" ", 1)[0] for line in interleaved]
    assert stamps == sorted(stamps)  # every rank's lines, in time order
    labels = {line.split(" ", 2)[1] for line in interleaved}
    assert labels == {"[algo-1,0]:", "[algo-1,1]:", "[algo-2,2]:", "[algo-2,3]:"}
    jobs = dtrain("jobs", home=dtrain_home)
    assert "good" in jobs.stdout and "Completed" in jobs.stdout
    plot = tmp_path / "metrics.png"
    metrics = dtrain("metrics", "good", "--plot", str(plot), home=dtrain_home)
    assert metrics.returncode == 0 and plot.stat().st_size > 0


def test_rank_that_raises_fails_the_job_fast(dtrain_home: Path) -> None:
    started = time.monotonic()
    result = run_script(dtrain_home, "raises.py", "raises", "--instance-count", "2")
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert elapsed < 30
    info = describe(dtrain_home, "raises")
    assert info["TrainingJobStatus"] == "Failed"
    assert info["FailureReason"].startswith("rank 1 (algo-2) exited with code 1")
    assert "ValueError: boom from rank 1" in info["FailureReason"]
    failure = Path(info["JobFolder"]) / "hosts" / "algo-2" / "output" / "failure"
    assert "Traceback (most recent call last)" in failure.read_text()
    assert "boom from rank 1" in result.stderr
    assert processes_of_job("raises") == []


def test_killed_rank_fails_the_job_leaves_no_grandchildren_and_is_retried_when_asked(
    dtrain_home: Path,
) -> None:
    """Both attempts end when rank 1 is killed, and neither leaves a rank's helpers behind."""
    started = time.monotonic()
    result = run_script(
        dtrain_home, "killed.py", "killed", "--processes-per-host", "2",
        "--max-retry-attempts", "1",
    )  # fmt: skip
    assert time.monotonic() - started < 60  # rank 0 sleeps for minutes: it was stopped, twice
    assert result.returncode == 1
    info = describe(dtrain_home, "killed")
    assert info["TrainingJobStatus"] == "Failed"
    assert info["FailureReason"].startswith("rank 1 (algo-1) was killed by SIGKILL")
    statuses = [t["Status"] for t in info["SecondaryStatusTransitions"]]
    assert statuses.count("Training") == 2 and "Restarting" in statuses
    failure = Path(info["JobFolder"]) / "hosts" / "algo-1" / "output" / "failure"
    assert "killed by SIGKILL" in failure.read_text()
    time.sleep(0.5)
    assert processes_of_job("killed") == []


def _start_in_background(home: Path, name: str, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", "run", "sleeps.py", "--source-dir", str(JOB_SCRIPTS),
         "--job-name", name, "--instance-type", "local_cpu", *flags],
        env={**os.environ, "DTRAIN_HOME": str(home)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _wait_for_training(home: Path, name: str, timeout: float = 60) -> None:
    """Until rank 0 has printed that it started, read from its log (a ``dtrain describe`` and
    a ``dtrain logs`` a poll started two processes every 0.3 s beside the job)."""
    log = home / "jobs" / name / "logs" / "attempt-1" / "rank0.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and "started" in log.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} never started training")


def test_two_jobs_at_once_and_dtrain_stop(dtrain_home: Path) -> None:
    first = _start_in_background(dtrain_home, "first", "--instance-count", "2")
    second = _start_in_background(dtrain_home, "second")
    try:
        _wait_for_training(dtrain_home, "first")
        _wait_for_training(dtrain_home, "second")
        jobs = dtrain("jobs", home=dtrain_home).stdout
        assert jobs.count("InProgress") == 2
        stopped = dtrain("stop", "first", home=dtrain_home)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout == "Stopping first ...\nfirst: Stopped\n"  # it waited for the end
        assert first.wait(timeout=30) == 3
        assert describe(dtrain_home, "first")["TrainingJobStatus"] == "Stopped"
        assert describe(dtrain_home, "second")["TrainingJobStatus"] == "InProgress"
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=30) == 3
        info = describe(dtrain_home, "second")
        assert info["TrainingJobStatus"] == "Stopped"
        assert "SIGINT" in info["SecondaryStatusTransitions"][-1]["StatusMessage"]
        assert processes_of_job("first") == [] and processes_of_job("second") == []
    finally:
        for process in (first, second):
            if process.poll() is None:
                process.kill()


def test_bad_input_is_rejected_before_launch(dtrain_home: Path) -> None:
    result = run_script(
        dtrain_home, "collective.py", "bad",
        "--distribution", '{"mpi": {"enabled": true, "process_per_host": 2}}',
    )  # fmt: skip
    assert result.returncode == 2
    assert "process_per_host" in result.stderr and "processes_per_host" in result.stderr
    assert "Traceback" not in result.stderr
    assert dtrain("describe", "bad", home=dtrain_home).returncode == 2
    missing = dtrain("run", "nope.py", home=dtrain_home)
    assert missing.returncode == 2 and "entry_point" in missing.stderr
    ml = run_script(dtrain_home, "collective.py", "ml", "--instance-type", "ml.p4d.24xlarge")
    assert ml.returncode == 2 and "local_gpu" in ml.stderr


def test_s3_channel_and_output_path(dtrain_home: Path, bucket: str) -> None:
    import boto3

    result = run_script(
        dtrain_home, "report.py", "on-s3", "--instance-count", "2",
        "--channel", f"training=s3://{bucket}/train/,distribution=ShardedByS3Key",
        "--output-path", f"s3://{bucket}/results",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    info = describe(dtrain_home, "on-s3")
    assert info["ModelArtifacts"]["S3ModelArtifacts"] == (
        f"s3://{bucket}/results/on-s3/output/model.tar.gz"
    )
    client = boto3.client("s3")
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert {"results/on-s3/output/model.tar.gz", "results/on-s3/output/output.tar.gz"} <= keys
    hosts = Path(info["JobFolder"]) / "hosts"
    shares = [
        sorted(p.relative_to(hosts / h / "input/data/training").as_posix()
               for p in (hosts / h / "input/data/training").rglob("*.csv"))
        for h in ("algo-1", "algo-2")
    ]  # fmt: skip
    assert sorted(shares[0] + shares[1]) == sorted(k.removeprefix("train/") for k in S3_KEYS)
    assert not set(shares[0]) & set(shares[1])


def test_logs_follow_until_max_run_stops_the_job(dtrain_home: Path) -> None:
    started = time.monotonic()
    job = _start_in_background(dtrain_home, "too-long", "--max-run", "3")
    try:
        _wait_for_training(dtrain_home, "too-long")
        follow = dtrain("logs", "too-long", "--follow", home=dtrain_home, timeout=60)
        assert follow.returncode == 0
        assert follow.stdout.startswith("[algo-1,0]: started")
        assert job.wait(timeout=30) == 3
        assert time.monotonic() - started < 60
        final = dtrain("logs", "too-long", "--rank", "0", home=dtrain_home).stdout
        assert final.count("\n") == follow.stdout.count("\n")
    finally:
        if job.poll() is None:
            job.kill()
    info = describe(dtrain_home, "too-long")
    assert info["TrainingJobStatus"] == "Stopped"
    assert info["SecondaryStatus"] == "MaxRuntimeExceeded"
    assert info["ModelArtifacts"]["S3ModelArtifacts"].endswith("too-long/output/model.tar.gz")
    assert processes_of_job("too-long") == []


def test_model_parallel_job_gets_mp_parameters(dtrain_home: Path) -> None:
    distribution = {
        "smdistributed": {
            "modelparallel": {"enabled": True, "parameters": {"partitions": 2, "microbatches": 4}}
        },
        "mpi": {"enabled": True, "processes_per_host": 2},
    }
    result = run_script(
        dtrain_home, "report.py", "mp-env", "--distribution", json.dumps(distribution)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_dir = Path(describe(dtrain_home, "mp-env")["JobFolder"])
    report = json.loads((job_dir / "hosts/algo-1/output/data/report-rank1.json").read_text())
    assert json.loads(report["env"]["SM_HP_MP_PARAMETERS"]) == {"microbatches": 4, "partitions": 2}
    assert report["argv"] == ["--mp_parameters", "microbatches=4,partitions=2"]
    framework = json.loads(report["env"]["SM_FRAMEWORK_PARAMS"])
    assert framework["sagemaker_mpi_enabled"] is True


def test_a_source_dir_holding_dtrains_home_is_copied_without_it(tmp_path: Path) -> None:
    """A project folder that holds both the code and dtrain's home: the job's code copy leaves
    the home out (copying it would copy the copy without end)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("import os\nprint(sorted(os.listdir('.')))\n")
    home = project / "dtrain-home"
    result = dtrain(
        "run", "train.py", "--source-dir", str(project), "--job-name", "home-inside",
        "--instance-type", "local_cpu", home=home,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "['train.py']" in result.stdout


@pytest.mark.parametrize(
    ("gpus", "inherited", "seen"),
    [
        (3, None, ["0", "1"]),  # one GPU per host, the third unused (homogeneous hosts)
        (4, "3,1,2,0", ["3,1", "2,0"]),  # an inherited CUDA_VISIBLE_DEVICES is shared out
        (1, None, ["", ""]),  # fewer GPUs than hosts: hidden, not all on GPU 0
    ],
)
def test_gpus_are_shared_out_between_hosts_and_hidden_when_too_few(
    dtrain_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    inherited: str | None,
    seen: list[str],
) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    fake = tools / "nvidia-smi"  # what `nvidia-smi --list-gpus` prints on a GPU machine
    lines = "".join(f"echo 'GPU {i}: Fake GPU (UUID: GPU-{i})'\n" for i in range(gpus))
    fake.write_text(f"#!/bin/sh\n{lines}")
    fake.chmod(0o755)
    env = {"PATH": f"{tools}:{os.environ['PATH']}"}
    if inherited is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # the fake GPUs must be seen
    else:
        env["CUDA_VISIBLE_DEVICES"] = inherited
    result = dtrain(
        "run", "report.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", "gpus",
        "--instance-type", "local", "--instance-count", "2", home=dtrain_home, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    job_dir = Path(describe(dtrain_home, "gpus")["JobFolder"])
    per_host = len(seen[0].split(",")) if seen[0] else 0
    for host, devices in enumerate(seen):  # one process per GPU, or one per host without
        rank = host * max(per_host, 1)
        report = job_dir / "hosts" / f"algo-{host + 1}" / "output/data" / f"report-rank{rank}.json"
        env_seen = json.loads(report.read_text())["env"]
        assert env_seen["CUDA_VISIBLE_DEVICES"] == devices
        assert env_seen["SM_NUM_GPUS"] == str(per_host)

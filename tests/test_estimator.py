"""The SageMaker-SDK look-alike: argument handling, and real jobs through fit()."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from dtrain.errors import ConfigError, DtrainError, JobFailedError
from dtrain.estimator import PyTorch, TrainingInput
from dtrain.jobs.store import JobStore
from tests.conftest import JOB_SCRIPTS, processes_of_job


def test_aws_only_arguments_are_ignored_with_one_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimator = PyTorch(
            entry_point="collective.py",
            role="arn:aws:iam::1:role/x",
            framework_version="2.0",
            py_version="py310",
            debugger_hook_config=False,
            instance_type="local",
        )
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "debugger_hook_config, framework_version, py_version, role" in message
    assert estimator.instance_type == "local"


def test_sagemaker_instance_type_gets_a_clear_error() -> None:
    with pytest.raises(ConfigError) as error:
        PyTorch(entry_point="train.py", instance_type="ml.p4d.24xlarge", instance_count=2)
    text = str(error.value)
    assert "ml.p4d.24xlarge" in text and "local_gpu" in text and "instance_count" in text


def test_misspelled_argument_is_a_type_error_with_suggestion() -> None:
    with pytest.raises(TypeError, match="did you mean 'hyperparameters'"):
        PyTorch(entry_point="train.py", hyperparameter={"a": 1})


def test_training_input_rejects_what_local_jobs_cannot_do() -> None:
    with pytest.raises(ConfigError, match="compression"):
        TrainingInput("s3://b/p", compression="Gzip")
    with pytest.raises(ConfigError, match="input_mode"):
        TrainingInput("s3://b/p", input_mode="Pipe")


def test_arguments_map_to_the_job_request(tmp_path: Path) -> None:
    estimator = PyTorch(
        entry_point="train.py",
        source_dir="src",
        instance_type="local_cpu",
        instance_count=2,
        processes_per_host=3,
        hyperparameters={"epochs": 1},
        distribution={"torch_distributed": {"enabled": True}},
        metric_definitions=[{"Name": "loss", "Regex": "loss=([0-9.]+)"}],
        max_run=600,
        checkpoint_local_path=str(tmp_path / "ckpt"),
        output_path="s3://bucket/out",
        environment={"A": "1"},
        base_job_name="base",
        max_retry_attempts=2,
        cluster="join://10.0.0.1:29400",
        secret_file="~/job.secret",
        join_timeout=30,
    )
    estimator.set_hyperparameters(lr=0.5)
    spec = estimator._spec({"training": TrainingInput("s3://bucket/train")}, job_name=None)
    assert spec.job_name.startswith("base-")
    assert (spec.entry_point, spec.source_dir) == ("train.py", "src")
    assert spec.instance_type == "local_cpu"
    assert (spec.instance_count, spec.processes_per_host) == (2, 3)
    assert spec.hyperparameters == {"epochs": 1, "lr": 0.5}
    assert spec.distribution == {"torch_distributed": {"enabled": True}}
    assert spec.metric_definitions == ({"Name": "loss", "Regex": "loss=([0-9.]+)"},)
    assert (spec.max_run, spec.max_retry_attempts) == (600, 2)
    assert spec.checkpoint_local_path == str(tmp_path / "ckpt")
    assert spec.output_path == "s3://bucket/out" and spec.environment == {"A": "1"}
    assert [(c.name, c.uri) for c in spec.channels] == [("training", "s3://bucket/train")]
    assert (spec.cluster, spec.secret_file) == ("join://10.0.0.1:29400", "~/job.secret")
    assert spec.join_timeout == 30
    assert estimator._spec(None, job_name="given").job_name == "given"


def test_fit_runs_a_job_and_exposes_its_artifacts(
    dtrain_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"f{i}").write_text(str(i))
    with pytest.warns(UserWarning, match="ignoring AWS-only arguments: role"):
        estimator = PyTorch(
            entry_point="collective.py",
            source_dir=str(JOB_SCRIPTS),
            instance_type="local_cpu",
            instance_count=2,
            hyperparameters={"epochs": 1},
            metric_definitions=[{"Name": "loss", "Regex": "loss=([0-9.]+)"}],
            role="ignored",
        )
    estimator.fit(
        {"training": TrainingInput(data.as_uri(), distribution="ShardedByS3Key")},
        job_name="from-estimator",
    )
    assert "[algo-2,1]: step=2 loss=101.0000" in capsys.readouterr().out  # logs=True shows them
    job = estimator.latest_training_job
    assert job is not None and job.name == "from-estimator"
    description = job.describe()
    assert description["TrainingJobStatus"] == "Completed"
    assert estimator.model_data.endswith("from-estimator/output/model.tar.gz")
    assert Path(estimator.model_data.removeprefix("file://")).is_file()
    folder = Path(description["JobFolder"]) / "hosts"
    host_files = [sorted(p.name for p in (folder / h / "input/data/training").iterdir())
                  for h in ("algo-1", "algo-2")]  # fmt: skip
    assert host_files == [["f0", "f2"], ["f1", "f3"]]
    assert description["FinalMetricDataList"][0]["MetricName"] == "loss"


def test_fit_without_wait_then_wait_and_failure_raises(dtrain_home: Path) -> None:
    estimator = PyTorch(
        entry_point="raises.py",
        source_dir=str(JOB_SCRIPTS),
        instance_type="local_cpu",
        instance_count=2,
    )
    estimator.fit(wait=False, job_name="background-failure")
    job = estimator.latest_training_job
    assert job is not None
    with pytest.raises(JobFailedError, match=r"rank 1 .* boom from rank 1"):
        job.wait(logs=False)
    assert job.describe()["TrainingJobStatus"] == "Failed"
    assert processes_of_job("background-failure") == []


def test_fit_without_wait_raises_when_the_job_cannot_start(dtrain_home: Path) -> None:
    JobStore().create("taken", "{}", dtrain_home / "elsewhere")
    estimator = PyTorch(entry_point="raises.py", source_dir=str(JOB_SCRIPTS))
    with pytest.raises(DtrainError, match=r"^job taken did not start: .*'taken' is already used"):
        estimator.fit(wait=False, job_name="taken")
    assert estimator.latest_training_job is None


def test_fit_validates_before_launching(dtrain_home: Path) -> None:
    estimator = PyTorch(
        entry_point="collective.py",
        source_dir=str(JOB_SCRIPTS),
        distribution={"smdistributed": {"modelparallel": {"enabled": True,
                                                          "parameters": {"microbatch": 4}}},
                      "mpi": {"enabled": True}},
    )  # fmt: skip
    with pytest.raises(ConfigError, match="did you mean 'microbatches'"):
        estimator.fit(job_name="never-runs")
    assert not (dtrain_home / "jobs" / "never-runs").exists()

"""Hostile input and everyday mistakes: each rejected before anything is created, the key named."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dtrain.errors import ConfigError, DtrainError
from dtrain.jobs.folder import make_private_dirs
from dtrain.jobs.spec import ChannelSpec, JobSpec
from dtrain.launch.job import prepare
from tests.conftest import dtrain


@pytest.fixture
def source(tmp_path: Path) -> Path:
    folder = tmp_path / "source"
    folder.mkdir()
    (folder / "train.py").write_text("print('trained')\n")
    return folder


def spec(source: Path, **fields: object) -> JobSpec:
    return JobSpec(
        **{"entry_point": "train.py", "job_name": "j", "source_dir": str(source), **fields}
    )  # type: ignore[arg-type]


def test_a_link_out_of_the_source_dir_is_refused_before_anything_is_copied(
    dtrain_home: Path, source: Path
) -> None:
    (source / "etc").symlink_to("/etc")
    result = dtrain("run", "train.py", "--source-dir", str(source), "--job-name", "links",
                    home=dtrain_home)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "source_dir" in result.stderr and "points to /etc" in result.stderr
    assert not (dtrain_home / "jobs" / "links").exists()
    assert dtrain("describe", "links", home=dtrain_home).returncode == 2


def test_links_inside_the_source_dir_travel_as_links(dtrain_home: Path, source: Path) -> None:
    (source / "alias.py").symlink_to("train.py")
    (source / "loop").symlink_to("loop")
    result = dtrain("run", "alias.py", "--source-dir", str(source), "--job-name", "inside",
                    "--instance-type", "local_cpu", home=dtrain_home)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    code = dtrain_home / "jobs" / "inside" / "hosts" / "algo-1" / "code"
    assert os.readlink(code / "alias.py") == "train.py" and os.readlink(code / "loop") == "loop"


@pytest.mark.parametrize("entry", ["/etc/hostname", "../outside.py"])
def test_an_entry_point_outside_the_source_dir_is_refused(
    source: Path, tmp_path: Path, entry: str
) -> None:
    (tmp_path / "outside.py").write_text("")
    with pytest.raises(ConfigError, match=r"entry_point.*relative to source_dir"):
        prepare(spec(source, entry_point=entry))


def test_a_channel_with_a_dangling_link_is_refused_before_launch(
    source: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("1\n")
    (data / "gone").symlink_to(tmp_path / "deleted")
    with pytest.raises(
        ConfigError, match=r"^channels\.train\.uri: .*/data/gone is a link to nothing"
    ):
        prepare(spec(source, channels=[ChannelSpec("train", str(data))]))


def test_checkpoint_and_output_folders_outside_the_home_are_private(
    dtrain_home: Path, source: Path, tmp_path: Path
) -> None:
    checkpoints, output = tmp_path / "shared" / "ckpt", tmp_path / "results" / "run"
    result = dtrain(
        "run", "train.py", "--source-dir", str(source), "--job-name", "private",
        "--instance-type", "local_cpu", "--checkpoint-local-path", str(checkpoints),
        "--output-path", str(output), home=dtrain_home,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    archive = output / "private" / "output" / "model.tar.gz"
    for folder in (tmp_path / "shared", checkpoints, tmp_path / "results", archive.parent):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    spec_file = dtrain_home / "jobs" / "private" / "spec.json"
    for file in (archive, spec_file, dtrain_home / "jobs.db"):  # the spec holds the environment
        assert file.stat().st_mode & 0o777 == 0o600, file
    assert len(json.loads(spec_file.read_text())["key_salt"]) == 32, "the job's own salt"


@pytest.mark.parametrize("key", ["checkpoint_local_path", "output_path"])
def test_a_checkpoint_or_output_folder_others_can_write_is_refused(
    dtrain_home: Path, source: Path, tmp_path: Path, key: str
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    refused = rf"{key}: .*can be written by its group or others \(mode 0775\).*chmod go-w"
    with pytest.raises(ConfigError, match=refused):
        prepare(spec(source, **{key: str(shared)}))
    shared.chmod(0o755)
    prepare(spec(source, **{key: str(shared)}))
    (shared / "checkpoints").mkdir(mode=0o777)
    (shared / "checkpoints").chmod(0o777)
    with pytest.raises(DtrainError, match="can be written by its group or others"):
        make_private_dirs(shared / "checkpoints")  # as each host's agent does


CHATTY = """
import sys
for i in range(20000):
    print(f"step={i} loss={1.0 / (i + 1):.6f}")
print("last line", flush=True)
if len(sys.argv) > 2:
    raise RuntimeError("the real error")
"""


@pytest.mark.parametrize("fails", [False, True])
def test_a_chatty_job_loses_no_line_and_no_metric(
    dtrain_home: Path, tmp_path: Path, fails: bool
) -> None:
    folder = tmp_path / "chatty"
    folder.mkdir()
    (folder / "chatty.py").write_text(CHATTY)
    result = dtrain(
        "run", "chatty.py", "--source-dir", str(folder), "--job-name", "chatty",
        "--instance-type", "local_cpu", "--quiet",
        "--hyperparameters", '{"fail": 1}' if fails else "{}",
        "--metric-definitions", '[{"Name": "loss", "Regex": "loss=([0-9.]+)"}]',
        home=dtrain_home, timeout=60,
    )  # fmt: skip
    assert result.returncode == (1 if fails else 0), result.stderr
    stamped = (dtrain_home / "jobs/chatty/logs/attempt-1/rank0.log").read_text().splitlines()
    log = [line.split(" ", 1)[1] for line in stamped]
    assert log[:20001] == [f"step={i} loss={1.0 / (i + 1):.6f}" for i in range(20000)] + [
        "last line"
    ]
    metrics = dtrain("metrics", "chatty", home=dtrain_home).stdout.splitlines()
    assert len(metrics) == 20001 and metrics[-1].split()[:2] == ["loss", "19999"]
    if fails:
        reason = json.loads(dtrain("describe", "chatty", home=dtrain_home).stdout)
        assert reason["FailureReason"].endswith("RuntimeError: the real error")


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("flags", "key", "allowed"),
    [
        (["--hyperparameters", '{"a=b": 1}'], "hyperparameters", "without '=' or NUL"),
        (["--hyperparameters", '{"a\\u0000": 1}'], "hyperparameters", "without '=' or NUL"),
        (["--hyperparameters", '{"a": "x\\u0000y"}'], "hyperparameters", "without NUL"),
        (["--hyperparameters", '{"a": ' + DEEP[:20_000] + DEEP[-20_000:] + "}"],
         "--hyperparameters", "nested less deeply"),
        (["--hyperparameters", '{"a": ' + "[" * 40 + "]" * 40 + "}"], "hyperparameters",
         "at most 32 levels"),
        (["--max-run", "nan"], "--max-run", "a duration such as 7d, 12h"),
        (["--max-run", "inf"], "--max-run", "a duration such as 7d, 12h"),
        (["--max-run", "0s"], "max_run", "finite number of seconds > 0"),
        (["--environment", "A=x\u0001"], None, None),
        (["--checkpoint-local-path", "/proc/dtrain-checkpoints"], "checkpoint_local_path",
         "a folder this user can write (/proc: "),
        (["--checkpoint-local-path", "/etc/hostname/ckpt"], "checkpoint_local_path",
         "/etc/hostname is not a folder"),
    ],
)  # fmt: skip
def test_values_no_process_could_take_are_rejected_before_launch(
    dtrain_home: Path, source: Path, flags: list[str], key: str | None, allowed: str | None
) -> None:
    result = dtrain("run", "train.py", "--source-dir", str(source), "--job-name", "bad",
                    "--instance-type", "local_cpu", *flags, home=dtrain_home)  # fmt: skip
    if key is None:  # a control character that is not NUL passes
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith(f"dtrain: error: {key}") and allowed in result.stderr
    assert "Traceback" not in result.stderr
    assert dtrain("describe", "bad", home=dtrain_home).returncode == 2


def test_s3_without_s3fs_or_credentials_is_rejected_before_launch(
    dtrain_home: Path, source: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    no_credentials = {
        "AWS_SHARED_CREDENTIALS_FILE": str(empty / "none"), "AWS_CONFIG_FILE": str(empty / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }  # fmt: skip
    for flag, key in (("--output-path", "output_path"), ("--channel", "channels.train.uri")):
        value = "s3://bucket/out" if flag == "--output-path" else "train=s3://bucket/train"
        result = dtrain("run", "train.py", "--source-dir", str(source), "--job-name", "s3",
                        flag, value, home=dtrain_home, env=no_credentials)  # fmt: skip
        assert result.returncode == 2 and result.stderr.startswith(f"dtrain: error: {key}")
        assert "AWS credentials" in result.stderr, result.stderr


def test_s3_without_s3fs_installed_is_rejected_before_launch(
    source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "s3fs" else find_spec(name)
    )
    with pytest.raises(ConfigError, match=r"output_path: .*pip install s3fs"):
        prepare(spec(source, output_path="s3://bucket/out"))


def test_too_much_for_a_process_and_deep_json_files_are_rejected_before_launch(
    source: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"hyperparameters: got '2000\d+ bytes in SM_"):
        prepare(spec(source, hyperparameters={"a": "x" * 200_000}))
    with pytest.raises(ConfigError, match=r"environment\.BIG: got '2000\d+ bytes in BIG'"):
        prepare(spec(source, environment={"BIG": "x" * 200_000}))
    many = {f"VAR{i}": "x" * 60_000 for i in range(40)}  # each fits, not all together
    with pytest.raises(ConfigError, match=r"and environment: .* bytes a process can be started"):
        prepare(spec(source, environment=many))
    deep = tmp_path / "distribution.json"
    deep.write_text(DEEP)
    from dtrain.config.distribution import load_distribution

    with pytest.raises(ConfigError, match="nested less deeply"):
        load_distribution(str(deep))


WRAPPER = """#!/bin/sh
python -c "import sys, torch; print('python', sys.executable)"
python -c "import sagemaker_training" 2>/dev/null || echo "base dir $SAGEMAKER_BASE_DIR"
"""


def test_a_wrapper_finds_the_jobs_python_and_the_sagemaker_base_dir(
    dtrain_home: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "wrapped"
    folder.mkdir()
    (folder / "run.sh").write_text(WRAPPER)
    result = dtrain("run", "run.sh", "--source-dir", str(folder), "--job-name", "wrapped",
                    "--instance-type", "local_cpu", home=dtrain_home,
                    env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"python {sys.executable}" in result.stdout
    host = dtrain_home / "jobs" / "wrapped" / "hosts" / "algo-1"
    assert f"base dir {host}" in result.stdout


def test_output_folders_others_can_write_are_refused_before_launch(
    dtrain_home: Path, source: Path, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for fields, key in [
        ({"output_path": str(shared)}, "output_path"),
        (
            {"tensorboard_output_config": {"S3OutputPath": shared.as_uri()}},
            "tensorboard_output_config.S3OutputPath",
        ),
    ]:
        with pytest.raises(ConfigError, match=rf"^{key}: .*can be written by its group or others"):
            prepare(spec(source, **fields))
    shared.chmod(0o700)
    prepared = prepare(spec(source, output_path=str(shared), tensorboard_output_config={
        "S3OutputPath": str(shared)
    }))  # fmt: skip
    assert prepared.output_url == prepared.tensorboard_url == shared.as_uri()

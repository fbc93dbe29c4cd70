"""Hostile input and everyday mistakes: each rejected before anything is created, the key named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dtrain.errors import ConfigError
from dtrain.jobs.spec import JobSpec
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
    assert archive.stat().st_mode & 0o777 == 0o600


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
    log = (dtrain_home / "jobs/chatty/logs/attempt-1/rank0.log").read_text().splitlines()
    assert log[:20001] == [f"step={i} loss={1.0 / (i + 1):.6f}" for i in range(20000)] + [
        "last line"
    ]
    metrics = dtrain("metrics", "chatty", home=dtrain_home).stdout.splitlines()
    assert len(metrics) == 20001 and metrics[-1].split()[:2] == ["loss", "19999"]
    if fails:
        reason = json.loads(dtrain("describe", "chatty", home=dtrain_home).stdout)
        assert reason["FailureReason"].endswith("RuntimeError: the real error")

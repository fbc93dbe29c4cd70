"""The README's demo command (``make demo``) runs the example job to completion."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dtrain.jobs.store import JobStore
from tests.conftest import dtrain

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(240)


def test_make_demo_trains_on_two_hosts(dtrain_home: Path, tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    if shutil.which("make") is None or not (bin_dir / "dtrain").exists():
        pytest.skip("needs make and the dtrain console script beside this python")
    data = tmp_path / "demo-data"
    result = subprocess.run(
        # -o: the environment running the tests is the install; never (re)create it here
        ["make", "-s", "-o", f"{bin_dir}/.installed-dtrain", "demo",
         f"VENV={bin_dir.parent}", f"DEMO_DATA={data}"],
        cwd=ROOT, capture_output=True, text=True, timeout=200, check=False,
        env={**os.environ, "DTRAIN_HOME": str(dtrain_home)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "epoch=5 train_loss=" in result.stdout

    (record,) = JobStore().list()
    assert record.name.startswith("demo-") and record.status == "Completed"
    info = json.loads(dtrain("describe", record.name, home=dtrain_home).stdout)
    metrics = {m["MetricName"]: m["Value"] for m in info["FinalMetricDataList"]}
    assert set(metrics) == {"train:loss", "train:accuracy"}
    assert metrics["train:accuracy"] > 0.5  # 4 separable classes: well above chance (0.25)
    hosts = Path(info["JobFolder"]) / "hosts"
    shards = [
        sorted(p.name for p in (hosts / host / "input/data/training").iterdir())
        for host in ("algo-1", "algo-2")
    ]
    assert shards == [["shard-00.pt", "shard-02.pt"], ["shard-01.pt", "shard-03.pt"]]
    artifact = Path(info["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("file://"))
    with tarfile.open(artifact) as tar:
        assert tar.getnames() == ["model.pt"]


def _make_says(target: str, venv: Path) -> str:
    """The commands ``make target`` would run (``-n``), for a ``.venv`` at ``venv``."""
    result = subprocess.run(
        ["make", "-n", target, f"VENV={venv}", "PYTHON=python3"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return result.stdout


def test_the_demo_installs_dtrain_alone_and_the_tests_add_their_tools(tmp_path: Path) -> None:
    """``make demo`` installs what dtrain needs (no ray, transformers, moto: a third of the
    size); ``make test`` (``install``) adds the test tools; either may come first."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    venv = tmp_path / "venv"
    demo = _make_says("demo", venv)
    assert f"python3 -m venv {venv}" in demo and "-c constraints.txt -e .\n" in demo
    assert "[test]" not in demo
    full = _make_says("install", venv)
    assert "-e .\n" in full and "-e '.[test]'" in full

    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / ".installed-dtrain").touch()  # after make demo: the test tools are added
    after_demo = _make_says("install", venv)
    assert "-m venv" not in after_demo and "-e '.[test]'" in after_demo
    (venv / "bin" / ".installed").touch()  # after make test: the demo installs nothing
    assert "pip" not in _make_says("demo", venv)
    assert "pip" not in _make_says("install", venv)


def _readme_example() -> list[str]:
    """The README's first ``dtrain run`` command (under "Running a job"), as words."""
    text = (ROOT / "README.md").read_text().split("## Running a job", 1)[1]
    block = text.split("```", 2)[1].replace("\\\n", " ")
    return shlex.split(next(line for line in block.splitlines() if line.startswith("dtrain run")))


def test_the_readme_example_trains_every_rank_on_rows_of_its_own(
    dtrain_home: Path, tmp_path: Path
) -> None:
    """2 hosts x 2 processes on a ShardedByS3Key channel: each host holds half the files and
    each of its processes half of those rows, so the four ranks report four different losses
    (two processes of a host training on the same rows would report the same)."""
    argv = _readme_example()
    assert argv[argv.index("--instance-count") + 1] == "2"
    assert argv[argv.index("--processes-per-host") + 1] == "2"
    data = tmp_path / "demo-data"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_dataset.py"), str(data)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    argv = [
        word.replace("out/demo-data", str(data)).replace("examples/", f"{ROOT}/examples/")
        for word in argv[1:]
    ]
    result = dtrain(*argv, "--job-name", "readme", home=dtrain_home, timeout=200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^\[(algo-\d),(\d)\]: rank \d/4 on .*: training on (\d+) rows$",
                      result.stdout, re.M)  # fmt: skip
    assert sorted(rows) == [("algo-1", "0", "256"), ("algo-1", "1", "256"),
                            ("algo-2", "2", "256"), ("algo-2", "3", "256")]  # fmt: skip
    losses: dict[str, list[str]] = {}
    for rank, loss in re.findall(r"^\[algo-\d,(\d)\]: epoch=\d train_loss=([0-9.]+)",
                                 result.stdout, re.M):  # fmt: skip
        losses.setdefault(rank, []).append(loss)
    assert sorted(losses) == ["0", "1", "2", "3"] and all(len(v) == 5 for v in losses.values())
    assert len({tuple(curve) for curve in losses.values()}) == 4, losses

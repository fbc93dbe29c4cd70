"""``dtrain ui`` as a person sees it: a real job, the server started as a user would, and the
pages rendered by headless Chromium (Debian's ``chromium``; skipped where it is missing)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import JOB_SCRIPTS, dtrain

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
JOB = "ui-job"
FAILED_JOB = "ui-failed"

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)"),
]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The address of ``dtrain ui`` over a store holding one finished 2-host job."""
    home = tmp_path_factory.mktemp("ui") / "home"
    metrics = [{"Name": "train:loss", "Regex": "train_loss=([0-9.]+)"}]
    result = dtrain(
        "run", "ui_job.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", JOB,
        "--instance-count", "2", "--instance-type", "local_cpu",
        "--metric-definitions", json.dumps(metrics), home=home,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    failed = dtrain(  # rank 1 raises; rank 0 ends with the follow-on error of its barrier
        "run", "raises.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", FAILED_JOB,
        "--instance-count", "2", "--instance-type", "local_cpu", home=home,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stderr
    server = subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", "ui", "--port", "0"],
        env={**os.environ, "DTRAIN_HOME": str(home)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        printed = server.stdout.readline() if server.stdout else ""
        address = re.search(r"http://127\.0\.0\.1:\d+/", printed)
        assert address, f"dtrain ui printed {printed!r}"
        yield address.group(0)
    finally:
        server.terminate()
        server.wait(timeout=10)


def browse(url: str, profile: Path, *action: str) -> str:
    """Chromium's output after the page's scripts ran (``--dump-dom``: the DOM)."""
    assert CHROMIUM is not None
    result = subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={profile}", "--window-size=1300,2200",
            "--virtual-time-budget=10000", *action, url,
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_jobs_table_shows_the_job(url: str, tmp_path: Path) -> None:
    dom = browse(url, tmp_path / "profile", "--dump-dom")
    assert 'data-ready="true"' in dom
    row = re.search(rf'<tr><td><a href="/jobs/{JOB}">{JOB}</a></td>.*?</tr>', dom)
    assert row, dom
    assert ">Completed<" in row.group(0) and "2 × 1" in row.group(0)
    assert "train:loss=0.125" in row.group(0)


def test_job_page_shows_chart_logs_timeline_and_files(url: str, tmp_path: Path) -> None:
    page = f"{url}jobs/{JOB}"
    dom = browse(page, tmp_path / "profile", "--dump-dom")
    assert 'data-ready="true"' in dom
    assert re.search(r'<div class="chart" data-metric="train:loss">.*?<canvas', dom, re.S)
    log = re.search(r'<pre id="log" class="log">(.*?)</pre>', dom, re.S)
    assert log and log.group(1).count("step=7 train_loss=0.1250") == 1, log
    assert re.search(r'<svg class="timeline".*?>rank 1</text>', dom, re.S)
    assert "<td>algo-2</td>" in dom and ">Completed</td>" in dom
    assert "hosts/algo-1/output/data/timeline.json</a>" in dom
    screenshot = tmp_path / "job-page.png"
    browse(page, tmp_path / "profile", f"--screenshot={screenshot}")
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 20_000  # a rendered page, not a blank one


def test_a_failed_jobs_page_opens_on_the_failing_ranks_log(url: str, tmp_path: Path) -> None:
    dom = browse(f"{url}jobs/{FAILED_JOB}", tmp_path / "profile", "--dump-dom")
    log = re.search(r'<pre id="log" class="log">(.*?)</pre>', dom, re.S)
    assert log and "ValueError: boom from rank 1" in log.group(1), log
    assert "waiting in barrier" not in log.group(1)  # rank 0's

"""One job whose rank 0 draws a tqdm-style progress bar and whose rank 1 writes nothing, run on a
terminal (a pseudo-terminal): the bar shows live on the console after its rank's label, the log
keeps it as one readable line, and the silent rank has an empty log."""

from __future__ import annotations

import contextlib
import io
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from dtrain.cli import main
from dtrain.launch.lines import settle
from tests.conftest import JOB_SCRIPTS

pytestmark = pytest.mark.timeout(120)
FRAME = "[algo-1,0]:  50%|#####     |"


def _run_on_a_terminal(home: Path, gate: Path) -> tuple[int, str]:
    """``dtrain run`` with a terminal as its console; the gate opens once the live frame shows."""
    primary, secondary = pty.openpty()
    job = subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", "run", "progress.py", "--source-dir",
         str(JOB_SCRIPTS), "--job-name", "progress", "--instance-type", "local_cpu",
         "--processes-per-host", "2", "--environment", f"PROGRESS_GATE={gate}"],
        env={**os.environ, "DTRAIN_HOME": str(home)},
        stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary,
    )  # fmt: skip
    os.close(secondary)
    seen = b""
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            if select.select([primary], [], [], 0.1)[0]:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # the terminal's other end closed: the job is over
                    break
                if not chunk:
                    break
                seen += chunk
                if FRAME.encode() in seen:
                    gate.touch()
        return job.wait(timeout=30), seen.decode()
    finally:
        os.close(primary)
        if job.poll() is None:
            job.kill()


@pytest.fixture(scope="module")
def progress(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    folder = tmp_path_factory.mktemp("progress")
    home = folder / "home"
    code, console = _run_on_a_terminal(home, folder / "gate")
    return home, code, console


def test_the_latest_frame_shows_live_after_its_rank(progress: tuple[Path, int, str]) -> None:
    _, code, console = progress
    assert code == 0, console
    assert FRAME in console  # drawn while the rank waited
    # What stays on the screen: each row as cleared (\r ESC[K) and overwritten (\r) last.
    rows = [settle(row.split("\r\x1b[K")[-1]) for row in console.split("\n")]
    training = next(i for i, row in enumerate(rows) if "Training: Training on" in row)
    assert rows[training + 1 : training + 3] == [
        "[algo-1,0]: 100%|##########|",
        "[algo-1,0]: done",
    ]
    assert "Uploading" in rows[training + 3]  # the frame left no trace


def logs(home: Path, *argv: str) -> tuple[int, str, str]:
    """``dtrain logs`` in this process (a fresh one costs a second or more on a loaded machine)."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, {"DTRAIN_HOME": str(home)}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        code = main(["logs", "progress", *argv])
    return code, out.getvalue(), err.getvalue()


def test_the_log_keeps_the_bar_once_as_it_ended(progress: tuple[Path, int, str]) -> None:
    home, _, _ = progress
    log = (home / "jobs/progress/logs/attempt-1/rank0.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in log] == ["100%|##########|", "done"]
    assert logs(home) == (0, "[algo-1,0]: 100%|##########|\n[algo-1,0]: done\n", "")
    stamped = logs(home, "--timestamps", "--tail", "1")
    assert stamped == (0, f"{log[-1].split(' ', 1)[0]} [algo-1,0]: done\n", "")


def test_a_rank_that_wrote_nothing_has_an_empty_log(progress: tuple[Path, int, str]) -> None:
    home, _, _ = progress
    assert logs(home, "--rank", "1") == (0, "", "")
    code, _, error = logs(home, "--rank", "2")
    assert code == 2 and "attempt 1 rank 1" in error

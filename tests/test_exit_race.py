"""Thirty jobs in a row whose ranks leave collectives pending at exit all complete (plain
``torchrun`` aborts a rank in most runs of this script here). About four minutes: marked
``stress``, run on demand with ``make stress``, not by ``make test``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import JOB_SCRIPTS, dtrain

RUNS = 30


@pytest.mark.stress
@pytest.mark.timeout(RUNS * 60)
def test_thirty_jobs_with_collectives_pending_at_exit_complete_in_a_row(dtrain_home: Path) -> None:
    for run in range(RUNS):
        name = f"pending-{run}"
        result = dtrain(
            "run", "pending_at_exit.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", name,
            "--instance-type", "local_cpu", "--processes-per-host", "2", home=dtrain_home,
        )  # fmt: skip
        assert result.returncode == 0, f"run {run + 1}: {result.stdout}{result.stderr}"
        logs = dtrain_home / "jobs" / name / "logs" / "attempt-1"
        for rank in range(2):
            assert f"rank {rank} atexit ran" in (logs / f"rank{rank}.log").read_text()

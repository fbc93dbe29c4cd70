"""Shared fixtures: every test gets its own DTRAIN_HOME so jobs never touch the user's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

JOB_SCRIPTS = Path(__file__).parent / "job_scripts"


@pytest.fixture
def dtrain_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = tmp_path / "dtrain-home"
    monkeypatch.setenv("DTRAIN_HOME", str(home))
    yield home


def dtrain(
    *args: str, home: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``dtrain`` CLI in a fresh process, as a user would."""
    full_env = {**os.environ, "DTRAIN_HOME": str(home), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dtrain.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        check=False,
    )


def processes_of_job(job_name: str) -> list[int]:
    """Pids of every live process started for ``job_name``.

    They are found by the environment we gave them.
    """
    marker = f"DTRAIN_JOB_NAME={job_name}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in environ and state != b"Z":
            found.append(int(entry))
    return found

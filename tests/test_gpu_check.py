"""``make gpu-check`` (tests/gpu_check.py) where there is no GPU, and its table of outcomes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import gpu_check


def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    """This machine's torch is built without CUDA, or its GPUs are hidden (the tests' default)."""
    ran = subprocess.run(
        [sys.executable, str(gpu_check.ROOT / "tests" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("make gpu-check needs a CUDA GPU: torch ")
    assert ran.stdout.rstrip().endswith("Nothing ran.")


def test_the_table_reads_each_tests_outcome_from_pytests_report(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu" name="test_job" time="12.5"/>'
        '<testcase classname="tests.modelparallel.test_gpu" name="test_amp[True]" time="3">'
        '<failure message="AssertionError: 1 != 2&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.modelparallel.test_gpu" name="test_two" time="0">'
        '<skipped type="pytest.skip" message="needs 2 GPUs, this machine has 1">x</skipped>'
        "</testcase></testsuite></testsuites>"
    )
    assert gpu_check._outcomes(report) == [
        ("test_gpu::test_job", "passed", 12.5, ""),
        ("modelparallel.test_gpu::test_amp[True]", "FAILED", 3.0, "AssertionError: 1 != 2"),
        ("modelparallel.test_gpu::test_two", "skipped", 0.0, "needs 2 GPUs, this machine has 1"),
    ]

"""``make gpu-check``: every CUDA path one GPU can exercise (the tests marked ``gpu``), then a
table of what passed. Without a CUDA GPU it says so and exits 0.

Where ranks need GPUs of their own (NCCL refuses two ranks on one GPU), the tests run one NCCL
rank (a job, the hierarchical reducer); where the library lets ranks share a GPU (a gloo world
with GPU tensors: pipelines, tp regions, FSDP2), two to four ranks share it. Tests that need
more GPUs than the machine has skip, saying how many.

It runs with the interpreter that runs it, whose torch must have CUDA (on the device machine,
``python3``), dtrain from ``src/``; the packages dtrain needs that this interpreter lacks are
installed first, without network, from the wheels in ``.whl/`` (``make gpu-wheels`` fetches
them where pip reaches PyPI) into ``.gpu-site/``. Exit status: pytest's, or 0 without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
SITE = ROOT / ".gpu-site"
NEEDED = ("re2", "cryptography", "numpy", "fsspec", "tqdm", "pytest", "pytest_timeout")
"""Modules the GPU tests import (dtrain's jobs and sealed messages, the test runner)."""
BUDGET_S = 480
"""The whole check, pytest included, must end within 8 minutes."""
WORKERS = 4
"""Tests at once: their ranks share the GPU (at most 4 ranks per test, 1-2 GiB each)."""


def _no_gpu() -> str | None:
    """Why this interpreter cannot run the check, or None."""
    if importlib.util.find_spec("torch") is None:
        return f"{sys.executable} has no torch"
    import torch

    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} ({sys.executable}) is built without CUDA; on a GPU "
            "machine run it with an interpreter whose torch has CUDA (make gpu-check "
            "GPU_PYTHON=python3)"
        )
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU on this machine"
    return None


def _installed() -> list[str]:
    """Install what is missing from ``.whl/``; the modules still missing."""
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing and WHEELS.is_dir():
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        command += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE)]
        subprocess.run([*command, *map(str, sorted(WHEELS.glob("*.whl")))], check=True)
        sys.path.insert(0, str(SITE))
        importlib.invalidate_caches()
        missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    return missing


def _gpu_test_files() -> list[str]:
    tests = ROOT / "tests"
    return sorted(
        str(path.relative_to(ROOT))
        for path in tests.rglob("test_*.py")
        if "mark.gpu" in path.read_text(encoding="utf-8")
    )


def _outcomes(report: Path) -> list[tuple[str, str, float, str]]:
    """(test, outcome, seconds, why: the first line of a failure's or skip's message) for each
    test of pytest's JUnit report."""
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        test = f"{case.get('classname', '').removeprefix('tests.')}::{case.get('name')}"
        outcome, why = "passed", ""
        for kind, shown in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "skipped")):
            found = case.find(kind)
            if found is not None:
                outcome, why = shown, (found.get("message") or "").split("\n")[0][:80]
                break
        rows.append((test, outcome, float(case.get("time", 0.0)), why))
    return rows


def main() -> int:
    started = time.monotonic()
    why = _no_gpu()
    if why is not None:
        print(f"make gpu-check needs a CUDA GPU: {why}. Nothing ran.")
        return 0
    import torch

    missing = _installed()
    if missing:
        print(
            f"make gpu-check: {sys.executable} lacks {', '.join(missing)} and .whl/ does not "
            "hold them: run `make gpu-wheels` where pip reaches PyPI and bring .whl/ along"
        )
        return 2
    name = torch.cuda.get_device_name(0)
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"
    print(f"{name} ({memory:.0f} GiB), {versions}")
    files = _gpu_test_files()
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, (str(ROOT / "src"), str(SITE), os.environ.get("PYTHONPATH")))
        ),
        # torch.cuda.is_available() then asks NVML: CUDA started in a process that ranks are
        # forked from (the tests' fork server) would be unusable in them.
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        report = Path(scratch) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider"]
        command += ["-q", "-rfEs", f"--junitxml={report}"]
        if importlib.util.find_spec("xdist") is not None:
            command += ["-n", str(WORKERS), "--dist", "load"]
        left = BUDGET_S - (time.monotonic() - started)
        try:
            code = subprocess.run(
                [*command, *files], cwd=ROOT, env=environment, timeout=left
            ).returncode
        except subprocess.TimeoutExpired:
            print(f"make gpu-check: the tests ran past {BUDGET_S} s and were stopped")
            return 1
        rows = _outcomes(report) if report.exists() else []
    width = max((len(test) for test, *_ in rows), default=4)
    print(f"\n{'test':<{width}}  {'result':<7}  {'s':>6}  why")
    for test, outcome, seconds, why in sorted(rows):
        print(f"{test:<{width}}  {outcome:<7}  {seconds:6.1f}  {why}")
    counts = {
        kind: sum(row[1] == kind for row in rows)
        for kind in ("passed", "FAILED", "ERROR", "skipped")
    }
    summary = ", ".join(f"{count} {kind.lower()}" for kind, count in counts.items() if count)
    print(f"\n{summary} in {time.monotonic() - started:.0f} s on {name}")
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Scripts written for SageMaker's smdistributed libraries run unmodified under dtrain run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dtrain.compat import SHIM_ROOT, real_smdistributed_installed, shim_pythonpath_entry
from tests.conftest import JOB_SCRIPTS, dtrain

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("script", "layout", "expected"),
    [
        ("smddp_v1.py", ["--instance-count", "2", "--processes-per-host", "2"], "smddp v1 ok"),
        ("smddp_backend.py", ["--processes-per-host", "2"], "smddp backend ok"),
    ],
)
def test_smddp_scripts_run_unmodified(
    dtrain_home: Path, script: str, layout: list[str], expected: str
) -> None:
    distribution = '{"smdistributed": {"dataparallel": {"enabled": true}}}'
    result = dtrain(
        "run", script, "--source-dir", str(JOB_SCRIPTS), "--instance-type", "local_cpu",
        "--distribution", distribution, *layout, home=dtrain_home,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    world = 4 if "--instance-count" in layout else 2
    assert result.stdout.count(expected) == world


def test_shim_is_used_only_without_a_real_installation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not real_smdistributed_installed()
    assert shim_pythonpath_entry() == str(SHIM_ROOT)
    real = tmp_path / "site" / "smdistributed"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "smdistributed", raising=False)
    assert real_smdistributed_installed()
    assert shim_pythonpath_entry() is None

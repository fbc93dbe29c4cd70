"""``dtrain plan`` on a model file written the SMP way imports ``smdistributed`` as a job does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dtrain.cli import EXIT_OK, main
from dtrain.compat import SHIM_ROOT

SMP_MODEL = """
import smdistributed.modelparallel.torch as smp
import torch
from torch import nn


def build():
    with smp.partition(0):
        first = nn.Linear(4, 8)
    with smp.partition(1):
        second = nn.Linear(8, 2)
    return nn.Sequential(first, nn.ReLU(), second)


def sample_batch():
    return torch.randn(2, 4)
"""


def test_a_model_file_that_imports_smdistributed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As a fresh `dtrain plan` process: no shim imported or on the path yet.
    for name in [name for name in sys.modules if name.split(".")[0] == "smdistributed"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry != str(SHIM_ROOT)])
    model = tmp_path / "smp_model.py"
    model.write_text(SMP_MODEL)
    assert main(["plan", f"{model}:build", "--partitions", "2", "--repeats", "1"]) == EXIT_OK
    assert "slowest partition:" in capsys.readouterr().out

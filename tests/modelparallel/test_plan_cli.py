"""``dtrain plan``: profile a model from a file, print its plan; bad input is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.cli import EXIT_BAD_INPUT, EXIT_OK, main
from dtrain.modelparallel.partition import PartitionPlan

GPT = Path(__file__).resolve().parents[2] / "examples" / "modelparallel" / "gpt.py"

TINY_MODEL = """
import torch
from torch import nn


def build():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def not_a_model():
    return 3


def one_tensor():
    return torch.randn(5, 4)
"""


def plan(*argv: str) -> int:
    return main(["plan", *argv, "--repeats", "1"])


def test_example_gpt_plan_with_json_and_dot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, dot = tmp_path / "plan.json", tmp_path / "plan.dot"
    code = plan(f"{GPT}:build_model", "--partitions", "2", "--json", str(out), "--dot", str(dot))
    printed = capsys.readouterr().out
    assert code == EXIT_OK
    assert printed.startswith("module ") and "slowest partition:" in printed
    assert "lm_head" in printed and "tied" in printed
    saved = PartitionPlan.from_dict(json.loads(out.read_text()))
    assert saved.partitions == 2 and set(saved.owners.values()) == {0, 1}
    assert saved.owner("lm_head") == saved.owner("wte") == 0
    assert dot.read_text().startswith("digraph partition_plan {")


def test_input_from_another_file_and_a_single_argument(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = tmp_path / "tiny.py"
    models.write_text(TINY_MODEL)
    code = plan(f"{models}:build", "--input", f"{models}:one_tensor", "--partitions", "3")
    assert code == EXIT_OK
    assert "(root)  Sequential" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["missing.py:build", "--partitions", "2"], "FILE:FACTORY: got 'missing.py:build'; "
            "allowed: FILE:FUNCTION naming an existing Python file (missing.py)"),
        (["{tiny}:biuld", "--partitions", "2"], "(did you mean 'build'?)"),
        (["{tiny}", "--partitions", "2"], "allowed: FILE:FUNCTION"),
        (["{tiny}:build", "--partitions", "0"], "--partitions: got 0; allowed: an integer >= 1"),
        (["{tiny}:build", "--partitions", "2", "--memory-weight", "2"], "--memory-weight: got 2.0"),
        (["{tiny}:build", "--partitions", "2", "--input", "nothing"], "--input: got 'nothing'"),
        (["{tiny}:build", "--partitions", "2"], "--input: got 'sample_batch'; allowed: a "
            "function of"),
        (["{tiny}:not_a_model", "--input", "one_tensor", "--partitions", "2"],
            "a function returning an nn.Module"),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    tiny = tmp_path / "tiny.py"
    tiny.write_text(TINY_MODEL)
    code = plan(*(arg.format(tiny=tiny) for arg in argv))
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert err.startswith("dtrain: error: ") and expected in err
    assert "Traceback" not in err

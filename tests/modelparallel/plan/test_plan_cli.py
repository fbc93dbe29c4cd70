"""``dtrain plan``: profile a model from a file, print its plan; bad input is a one-line error."""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from dtrain.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, main
from dtrain.config.modelparallel import validate_mp_parameters
from dtrain.modelparallel.api.placement import manual_placements
from dtrain.modelparallel.plan import profile as profile_py
from dtrain.modelparallel.plan.partition import PartitionPlan
from dtrain.modelparallel.plan.profile import profile_module
from dtrain.modelparallel.plan.solver import auto_plan

GPT = Path(__file__).resolve().parents[3] / "examples" / "modelparallel" / "gpt.py"

TINY_MODEL = """
import torch
from torch import nn


def build():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def not_a_model():
    return 3


def one_tensor():
    return torch.randn(5, 4)


def deep():
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])


def two_samples():
    return torch.randn(2, 64)
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


def test_a_plan_without_memory_has_the_exact_operation_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model made on the meta device: no times, but the same operation counts, sizes and
    ties as the timed profile, and every partition used."""
    timed, meta = tmp_path / "timed.json", tmp_path / "meta.json"
    assert plan(f"{GPT}:build_model", "--partitions", "2", "--json", str(timed)) == EXIT_OK
    argv = [f"{GPT}:build_model", "--partitions", "2", "--without-memory", "--json", str(meta)]
    assert main(["plan", *argv]) == EXIT_OK
    capsys.readouterr()
    timed_plan = PartitionPlan.from_dict(json.loads(timed.read_text()))
    meta_plan = PartitionPlan.from_dict(json.loads(meta.read_text()))
    assert set(meta_plan.owners.values()) == {0, 1}
    assert meta_plan.owner("lm_head") == meta_plan.owner("wte") == 0
    for name, entry in timed_plan.modules.items():
        assert meta_plan.modules[name].param_count == entry.param_count, name
    assert sum(s.flops for s in meta_plan.stages) == sum(s.flops for s in timed_plan.stages) > 0


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
        (["{tiny}:build", "--partitions", "2", "--memory-per-rank", "8G"],
            "--memory-per-rank: got '8G'; allowed: a size such as 8GiB, 512MiB, 8GB or "
            "1073741824 (bytes)"),
        (["{tiny}:build", "--partitions", "2", "--optimizer", "adamm"],
            "--optimizer: got 'adamm'; allowed: adam, adamw, sgd-momentum, sgd (did you mean "
            "'adam'?)"),
        (["{tiny}:build", "--partitions", "2", "--pipeline", "simpel"],
            "--pipeline: got 'simpel'; allowed: simple, interleaved (did you mean 'simple'?)"),
        (["{tiny}:build", "--partitions", "2", "--microbatches", "2", "--active-microbatches",
            "3"], "--active-microbatches: got 3; allowed: an integer from 1 to --microbatches (2)"),
        (["{tiny}:build", "--partitions", "4", "--max-partitions", "3"],
            "--max-partitions: got 3; allowed: an integer >= --partitions (4)"),
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


def test_the_command_plans_as_a_job_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dtrain plan`` profiles as a job's first step does (``profile_module`` with a job's
    repeats) and plans that profile as a job would: the same owners. The profile the command
    made is the one planned again here, as two timed profiles of one model may cut apart."""
    profiles: list[Any] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        profiles.append((kwargs, profile_module(*args, **kwargs)))
        return profiles[-1][1]

    monkeypatch.setattr(profile_py, "profile_module", recorded)
    out = tmp_path / "plan.json"
    command = ["plan", f"{GPT}:build_model", "--partitions", "2", "--json", str(out)]
    assert main(command) == EXIT_OK
    planned = PartitionPlan.from_dict(json.loads(out.read_text()))
    ((used, profile),) = profiles
    job_repeats = inspect.signature(profile_module).parameters["repeats"].default
    assert used["repeats"] == job_repeats
    # What DistributedModel does at the first step with that profile: auto_plan with the
    # configured memory weight and the smp.partition placements.
    spec = importlib.util.spec_from_file_location("_gpt_example", GPT)
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpt  # its dataclasses look their module up
    spec.loader.exec_module(gpt)
    config = validate_mp_parameters({"partitions": 2})
    job = auto_plan(
        profile,
        config["pipeline_parallel_degree"],
        memory_weight=config["memory_weight"],
        fixed=manual_placements(gpt.build_model()),
    )
    assert job.owners == planned.owners


def test_memory_per_rank_names_the_layout_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """8 layers of 16.25 KiB of parameters, 65 KiB each with gradients and Adam's state: 260 KiB
    per partition at pp=2, 195 at pp=3, 130 at pp=4 (activations are 512 B a layer)."""
    models = tmp_path / "deep.py"
    models.write_text(TINY_MODEL)
    argv = [f"{models}:deep", "--input", "two_samples", "--partitions", "2"]
    code = plan(*argv, "--memory-per-rank", "160KiB")
    captured = capsys.readouterr()
    assert code == EXIT_FAILED
    assert "peak memory" in captured.out  # the plan is shown before the verdict
    assert captured.err.startswith("dtrain: partition ")
    assert "more than the 160.0 KiB allowed per rank: params 65.0 KiB" in captured.err
    assert (
        "A layout that fits: partitions 2 -> 4 (interleaved pipeline, 1 microbatch, at most 1 "
        "in flight; largest partition 131.0 KiB)"
    ) in captured.err

    out = tmp_path / "plan.json"
    code = plan(
        *argv, "--memory-per-rank", "1GiB", "--bf16", "--optimizer", "sgd", "--json", str(out)
    )
    assert code == EXIT_OK
    printed = capsys.readouterr().out
    assert "every partition fits 1GiB per rank" in printed
    assert "sgd (0 state tensors per parameter), bf16 parameters with fp32 masters" in printed
    saved = json.loads(out.read_text())
    assert saved["memory_settings"]["half_precision"] == "bf16"
    peak = saved["stages"][0]["peak_memory"]
    assert peak["params"] == 4 * 2 * (64 * 64 + 64)  # 4 layers, 2 bytes a parameter
    assert peak["master"] == 2 * peak["params"] and peak["optimizer"] == 0
    assert PartitionPlan.from_dict(saved).peak_memory[0].total == sum(
        value for key, value in peak.items() if key != "held_microbatches"
    )

"""An unmodified SMP training script as a ``dtrain run`` job: pipeline × data parallel, 2 hosts."""

from __future__ import annotations

import json
import re
import tarfile
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import dtrain, processes_of_job

EXAMPLES = Path(__file__).parents[2] / "examples" / "modelparallel"


@pytest.mark.timeout(300)
def test_smp_script_trains_as_a_two_host_hybrid_job(dtrain_home: Path, tmp_path: Path) -> None:
    distribution = {
        "smdistributed": {
            "modelparallel": {
                "enabled": True,
                "parameters": {"partitions": 2, "microbatches": 2, "ddp": True},
            }
        },
        "mpi": {"enabled": True, "processes_per_host": 2},
    }
    result = dtrain(
        "run", "train_smp.py", "--source-dir", str(EXAMPLES), "--job-name", "smp-hybrid",
        "--instance-count", "2", "--processes-per-host", "2", "--instance-type", "local_cpu",
        "--distribution", json.dumps(distribution), "--hyperparameters", '{"steps": 8}',
        "--output-path", str(tmp_path / "out"), "--environment", "DTRAIN_MP_TRACE=trace.json",
        home=dtrain_home, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [
        float(x) for x in re.findall(r"\[algo-1,0\]: step=\d+ train_loss=([0-9.]+)", result.stdout)
    ]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    assert "slowest partition" in result.stdout  # the partition plan table
    assert processes_of_job("smp-hybrid") == []

    info = json.loads(dtrain("describe", "smp-hybrid", home=dtrain_home).stdout)
    artifact = Path(info["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("file://"))
    with tarfile.open(artifact) as tar:
        tar.extract("model.pt", tmp_path, filter="data")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert any(name.startswith("blocks.3.") for name in state)  # gathered from partition 1

    # The script never asked for a trace: the environment did, and it came back with the output.
    with tarfile.open(artifact.with_name("output.tar.gz")) as tar:
        tar.extract("trace.json", tmp_path, filter="data")
    trace = json.loads((tmp_path / "trace.json").read_text())
    kinds = {(e["pid"], e["cat"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {(0, "F"), (0, "SEND"), (0, "WAIT"), (1, "RECV"), (1, "F")} <= kinds


FAILING_SCRIPT = """
import torch
import smdistributed.modelparallel.torch as smp

smp.init({"partitions": 2, "microbatches": 2})
first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
smp.set_partition(second, 1)
model = smp.DistributedModel(torch.nn.Sequential(first, second))

@smp.step
def train_step(model, x):
    loss = model(x).sum()
    model.backward(loss)
    return loss

train_step(model, torch.ones(4, 4))
if smp.rank() == 0:
    raise RuntimeError("the leader gives up after its first step")
train_step(model, torch.ones(4, 4))  # the other rank waits in its second step
"""


@pytest.mark.timeout(120)
def test_a_rank_dying_of_an_exception_ends_the_job_without_waiting_for_its_peers(
    dtrain_home: Path, tmp_path: Path
) -> None:
    """A script that ends normally stops with its peers at exit (train_smp.py above never calls
    smp.shutdown()); one that dies of an exception must not wait for them: they may be inside a
    step, waiting for it."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "fail.py").write_text(FAILING_SCRIPT)
    start = time.monotonic()
    result = dtrain(
        "run", "fail.py", "--source-dir", str(source), "--job-name", "smp-dies",
        "--processes-per-host", "2", "--instance-type", "local_cpu",
        "--output-path", str(tmp_path / "out"), home=dtrain_home, timeout=110,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "the leader gives up after its first step" in result.stdout + result.stderr
    assert "rank 0" in result.stdout + result.stderr
    assert elapsed < 40, elapsed  # the exit wait for peers is 60 s
    assert processes_of_job("smp-dies") == []

"""A host's GPUs: how they are counted, and which jobs may run more processes than GPUs.

The machine's GPUs are faked: an ``nvidia-smi`` on the PATH that lists them, or none and a
driver folder with torch's count standing in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtrain.errors import ConfigError
from dtrain.jobs.spec import JobSpec
from dtrain.launch import machine
from dtrain.launch.job import prepare


def fake_nvidia_smi(tools: Path, gpus: int) -> None:
    """What ``nvidia-smi --list-gpus`` prints on a machine with ``gpus`` GPUs."""
    tools.mkdir(exist_ok=True)
    lines = "".join(f"echo 'GPU {i}: Fake GPU (UUID: GPU-{i})'\n" for i in range(gpus))
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\n{lines}")
    (tools / "nvidia-smi").chmod(0o755)


@pytest.fixture
def no_gpus_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH without ``nvidia-smi`` (returned: where a fake one goes), no driver, all GPUs
    visible."""
    tools = tmp_path / "tools"
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(machine, "NVIDIA_DRIVER", tmp_path / "no-driver")
    return tools


def test_gpus_are_counted_by_nvidia_smi_else_by_torch_where_the_driver_is(
    no_gpus_visible: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert machine.count_gpus() == 0  # no nvidia-smi, no driver: a CPU machine
    driver = tmp_path / "driver"
    driver.mkdir()
    monkeypatch.setattr(machine, "NVIDIA_DRIVER", driver)
    assert machine.visible_gpus() == ["0", "1"]  # the driver, without nvidia-smi: torch counts
    fake_nvidia_smi(no_gpus_visible, 3)
    assert machine.visible_gpus() == ["0", "1", "2"]


MODEL_PARALLEL = {
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}},
    "mpi": {"enabled": True},
}
DATA_PARALLEL = {"smdistributed": {"dataparallel": {"enabled": True}}}


@pytest.mark.parametrize(
    ("distribution", "shares"), [(MODEL_PARALLEL, True), (DATA_PARALLEL, False), (None, False)]
)
def test_only_model_parallel_ranks_may_share_a_gpu(
    no_gpus_visible: Path, tmp_path: Path, distribution: dict[str, object] | None, shares: bool
) -> None:
    fake_nvidia_smi(no_gpus_visible, 1)
    (tmp_path / "train.py").write_text("")
    spec = JobSpec(
        "train.py", "j", processes_per_host=2, distribution=distribution, source_dir=str(tmp_path)
    )
    if shares:  # smp.init makes a gloo world, both ranks compute on the one GPU
        assert prepare(spec).distribution.processes_per_host == 2
    else:
        with pytest.raises(ConfigError, match=r"at most the 1 GPU.*only model-parallel jobs"):
            prepare(spec)

"""The GPU path (NCCL), run where CUDA GPUs are (never in CI): a ``local_gpu`` job gives each rank
its own GPU, and dtrain's data parallelism trains as torch's DDP does (on one GPU, one NCCL
rank: the reducer's buckets, streams and collectives all the same)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from tests.conftest import JOB_SCRIPTS, dtrain

pytestmark = pytest.mark.gpu


def test_a_local_gpu_job_trains_on_one_distinct_gpu_per_rank_as_torch_ddp(
    dtrain_home: Path, tmp_path: Path
) -> None:
    ranks = torch.cuda.device_count()
    result = dtrain(
        "run", "gpu_ddp.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", "gpu",
        "--instance-type", "local_gpu", home=dtrain_home, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    info = json.loads(dtrain("describe", "gpu", home=dtrain_home).stdout)
    assert info["ResourceConfig"]["ProcessesPerHost"] == ranks  # one process per GPU
    archive = Path(info["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("file://"))
    with tarfile.open(archive) as tar:
        tar.extract("gpu.pt", tmp_path, filter="data")
    trained = torch.load(tmp_path / "gpu.pt", weights_only=True)
    assert len(set(trained["uuids"])) == ranks
    for name, value in trained["torch"].items():
        torch.testing.assert_close(trained["ours"][name], value, rtol=1e-4, atol=1e-5)

"""An SMP v2 script (``tests/job_scripts/smp_v2.py``: smddp, ``tsm.init()``, ``tsm.state``, one
FSDP step over smddp) run as ``dtrain run`` runs AWS's distribution, and under plain torchrun
through the documented entry: both read the same state, and dtrain's ranks get every variable
torchrun's get."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import JOB_SCRIPTS, dtrain, processes_of_job

PARAMETERS = {"hybrid_shard_degree": 2, "sm_activation_offloading": False}
DISTRIBUTION = {
    "torch_distributed": {"enabled": True},
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": PARAMETERS}},
}
TORCHRUN_ONLY = {
    "TORCHELASTIC_ERROR_FILE": "where torchrun's @record writes a failed rank's error; dtrain "
    "reports a failed rank's traceback itself",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "torchrun's own setting (its agent reads it), inherited",
}
PER_LAUNCH = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
"""Where each launch puts its store and what it names its run; every other variable torchrun
gives a rank, dtrain gives it with the same value."""


def states(stdout: str) -> dict[int, dict[str, Any]]:
    found = [json.loads(m) for m in re.findall(r"STATE (\{.*\})", stdout)]
    return {state["rank"]: state for state in found}


def run_torchrun(cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2 -m dtrain.launch.entry smp_v2.py`` with the
    job's parameters where SageMaker puts them; its process group is killed if it overruns."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "dtrain.launch.entry", str(JOB_SCRIPTS / "smp_v2.py"),
    ]  # fmt: skip
    env = {**os.environ, "SM_HP_MP_PARAMETERS": json.dumps(PARAMETERS)}
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.timeout(240)
def test_smp_v2_script_under_dtrain_run_and_under_torchrun(
    dtrain_home: Path, tmp_path: Path
) -> None:
    job = dtrain(
        "run", "smp_v2.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", "smp-v2",
        "--instance-type", "local_cpu", "--processes-per-host", "2",
        "--distribution", json.dumps(DISTRIBUTION), home=dtrain_home, timeout=110,
    )  # fmt: skip
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert job.stdout.count("FSDP OK") == 2
    assert processes_of_job("smp-v2") == []
    in_job = states(job.stdout)
    for rank in (0, 1):
        state = in_job[rank]
        assert state["backend"] == "smddp"
        assert state["degrees"] == [1, 1, 1, 2]  # tp, cp, ep, hybrid shard
        assert state["tp"] == [0, 1, [rank]]
        assert state["cp"] == [0, 1]
        assert state["rep"] == [0, [[0], [1]]]
        assert state["dp_rank"] == rank
        assert state["offloading"] is False  # the job's parameter, default true
        assert state["fsdp_mesh"] == [[0, 1]]

    torchrun = run_torchrun(tmp_path, timeout=110)
    assert torchrun.returncode == 0, torchrun.stdout[-3000:] + torchrun.stderr[-3000:]
    assert torchrun.stdout.count("FSDP OK") == 2
    under_torchrun = states(torchrun.stdout)
    for rank in (0, 1):
        launched = under_torchrun[rank].pop("launcher")
        given = in_job[rank].pop("launcher")
        assert launched.keys() - TORCHRUN_ONLY.keys() <= given.keys()
        same = launched.keys() - TORCHRUN_ONLY.keys() - PER_LAUNCH
        assert {name: given[name] for name in same} == {name: launched[name] for name in same}
        assert under_torchrun[rank] == in_job[rank]

"""The Slurm recipe (examples/clusters/slurm/dtrain.sbatch), as a user submits it, on a real
one-node Slurm: two tasks are two hosts. Skipped where Slurm is not installed (``.ci/run``
installs it where it can)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import dtrain
from tests.launch import slurm

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "clusters" / "slurm" / "dtrain.sbatch"
sys.path.insert(0, str(ROOT / "benchmarks"))
import _netns  # noqa: E402 - benchmarks/ is not a package

pytestmark = pytest.mark.timeout(180)
TWO_HOSTS = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2"]
"""The recipe asks for one task a node; here both tasks share the one node."""

SCRIPTS = {
    "hosts.py": "import os\n"
    "print(os.environ['SM_CURRENT_HOST'], 'is Slurm task', os.environ['SLURM_PROCID'])\n",
    "fails.py": "raise SystemExit('the training failed')\n",
    "waits.py": "import time\nprint('training', flush=True)\ntime.sleep(600)\n",
}
"""Job scripts without torch: what is tested is the recipe, not training."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm.Slurm]:
    reason = slurm.missing() or _netns.unavailable_reason()
    if reason:
        pytest.skip(f"Slurm: {reason}")
    try:
        with _netns.veth_pair(prefix="dts", rate=None) as machines:
            folder = tmp_path_factory.mktemp("slurm")
            with slurm.cluster(machines[0].namespace, machines[0].address, folder) as started:
                yield started
    except _netns.NetnsUnavailable as error:
        pytest.skip(f"network namespaces: {error}")


class Ended(NamedTuple):
    state: str
    """Slurm's record of the job: COMPLETED, FAILED, ..."""
    exit_code: str
    """The batch script's, ``status:signal``."""
    output: str
    left: list[str]
    """Secrets the job left in ~/.dtrain (its own is removed)."""


Submit = Callable[..., Ended]


@pytest.fixture
def submit(cluster: slurm.Slurm, tmp_path: Path) -> Submit:
    """Submit the recipe with ``dtrain run``'s arguments; the job's Slurm state and output."""
    source = tmp_path / "code"
    source.mkdir()
    for name, text in SCRIPTS.items():
        (source / name).write_text(text)
    home = tmp_path / "home"  # the shared $HOME that carries the secret
    home.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("DTRAIN_HOME", None)  # dtrain's default, ~/.dtrain, which the recipe makes first

    def run(script: str, *flags: str, cancel: Sequence[str] | None = None) -> Ended:
        """``cancel``: ``scancel``'s options, once the job printed "training"."""
        job = cluster.submit(
            RECIPE, script, "--source-dir", str(source), "--instance-type", "local_cpu",
            *flags, env=env, options=TWO_HOSTS,
        )  # fmt: skip
        if cancel is not None:
            cluster.wait_for(job, "training", timeout=60)
            cluster.run("scancel", *cancel, job)
        ended = cluster.wait(job, timeout=120)
        return Ended(*ended, [path.name for path in (home / ".dtrain").glob("*.secret")])

    return run


def test_each_task_is_its_own_host_and_the_job_completes(submit: Submit) -> None:
    ended = submit("hosts.py")
    assert ended.state == "COMPLETED", ended.output
    assert "algo-1 is Slurm task 0" in ended.output
    assert "algo-2 is Slurm task 1" in ended.output
    assert "Completed: Training job completed" in ended.output
    assert ended.left == []


def test_a_failed_training_job_is_a_failed_slurm_job(submit: Submit) -> None:
    ended = submit("fails.py")
    assert ended.state == "FAILED", ended.output
    assert "the training failed" in ended.output
    assert ended.left == []


def test_a_job_dtrain_refuses_ends_at_once_with_its_agents(submit: Submit) -> None:
    # dtrain run exits before any agent joins (and, with its own secret file, before it wrote
    # one): the agents, trying to join for 600 s, are ended with it.
    ended = submit("fial.py")
    assert ended.state == "FAILED", ended.output
    assert "entry_point: got 'fial.py'" in ended.output
    assert ended.left == []


def status(name: str, home: Path) -> str:
    described = dtrain("describe", name, home=home)
    return str(json.loads(described.stdout)["TrainingJobStatus"])


def test_the_batch_script_signalled_stops_the_job_with_its_model(
    submit: Submit, tmp_path: Path
) -> None:
    # What Slurm does before the time limit (--signal=B:TERM@120), and scancel --batch.
    ended = submit("waits.py", "--job-name", "stopped", cancel=["--batch", "--signal=TERM"])
    assert (ended.state, ended.exit_code) == ("FAILED", "3:0"), ended.output
    assert status("stopped", tmp_path / "home" / ".dtrain") == "Stopped"
    assert (tmp_path / "home/.dtrain/output/stopped/output/model.tar.gz").is_file()
    assert ended.left == []


def test_a_cancelled_slurm_job_ends_every_process_of_the_job(
    submit: Submit, cluster: slurm.Slurm, tmp_path: Path
) -> None:
    ended = submit("waits.py", "--job-name", "cancelled", cancel=[])
    assert ended.state == "CANCELLED", ended.output
    cluster.wait_for_no_job_processes(timeout=30)  # KillWait is 5 s: well before
    assert status("cancelled", tmp_path / "home" / ".dtrain") in ("Stopped", "Failed")

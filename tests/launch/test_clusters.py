"""Jobs across machines: two network namespaces joined by a veth pair are the two machines.

The controller runs on the first; an agent on each joins it (``join://``). Every test checks what a
user would: the job trains as one process would, every host gets its own contract, and failures
anywhere end the job everywhere, named, with nothing left running on either machine.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import torch

from dtrain.launch.processes import marked_processes, signal_pids
from tests.conftest import JOB_SCRIPTS, dtrain, processes_of_job

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _netns  # noqa: E402 - benchmarks/ is not a package

pytestmark = pytest.mark.timeout(180)
PORTS = itertools.count(20000 + os.getpid() % 20000)


@pytest.fixture(scope="module")
def machines() -> Iterator[tuple[_netns.Host, _netns.Host]]:
    reason = _netns.unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    try:
        with _netns.veth_pair(prefix="dtt", rate=None) as hosts:
            yield hosts
    except _netns.NetnsUnavailable as error:
        pytest.skip(f"network namespaces: {error}")


class Cluster:
    """Processes started inside the machines; every one is killed at the end of the test."""

    def __init__(self, machines: tuple[_netns.Host, _netns.Host], home: Path, tmp: Path) -> None:
        self.a, self.b = machines
        self.home = home
        self.tmp = tmp
        self.port = next(PORTS)
        self.secret = tmp / "secret"
        self.processes: list[subprocess.Popen[str]] = []

    @property
    def join(self) -> str:
        return f"{self.a.address}:{self.port}"

    def start(self, machine: _netns.Host, name: str, *args: str) -> subprocess.Popen[str]:
        log = (self.tmp / f"{name}.log").open("w")
        process = subprocess.Popen(
            machine.command([sys.executable, "-m", "dtrain.cli", *args]),
            env={**os.environ, "DTRAIN_HOME": str(self.home)},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def controller(
        self, script: str, job: str, *flags: str, cluster: str | None = None
    ) -> subprocess.Popen[str]:
        where = ["--cluster", cluster] if cluster else [
            "--cluster", f"join://{self.join}", "--secret-file", str(self.secret),
        ]  # fmt: skip
        return self.start(
            self.a, "controller", "run", script, "--source-dir", str(JOB_SCRIPTS),
            "--job-name", job, "--instance-type", "local_cpu", "--instance-count", "2",
            "--environment", f"PYTHONPATH={ROOT}", *where, *flags,
        )  # fmt: skip

    def agents(self) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
        deadline = time.monotonic() + 30
        while not self.secret.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the controller creates it
        started = [
            self.start(
                machine,
                f"agent-{host}",
                "agent",
                "--join",
                self.join,
                "--secret-file",
                str(self.secret),
                "--host",
                host,
            )
            for machine, host in ((self.a, "algo-1"), (self.b, "algo-2"))
        ]
        return started[0], started[1]

    def describe(self, job: str) -> dict:
        result = dtrain("describe", job, home=self.home)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def wait(self, process: subprocess.Popen[str], timeout: float = 120) -> int:
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(self.output("controller")[-3000:]) from None

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture
def cluster(
    machines: tuple[_netns.Host, _netns.Host], dtrain_home: Path, tmp_path: Path
) -> Iterator[Cluster]:
    started = Cluster(machines, dtrain_home, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()


def artifact(info: dict, member: str, tmp: Path) -> object:
    path = Path(info["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("file://"))
    with tarfile.open(path) as tar:
        tar.extract(member, tmp, filter="data")
    return torch.load(tmp / member, weights_only=True)


def on_host(job: str, host: str) -> list[int]:
    """The job's live processes on ``host``: found by the environment their agent gave them."""
    marker = f"SM_CURRENT_HOST={host}".encode()
    found = []
    for pid in processes_of_job(job):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in environ:
            found.append(pid)
    return found


def check_data_parallel_job(cluster: Cluster, job: str, tmp_path: Path, per_host: int) -> None:
    """The data-parallel job of 2 hosts x ``per_host`` ranks trained as one process would, with
    each host's contract."""
    from tests.dataparallel.scenarios import reference_global

    world = 2 * per_host
    info = cluster.describe(job)
    assert [(h["Name"], h["Address"], h["Interface"]) for h in info["Hosts"]] == [
        ("algo-1", cluster.a.address, cluster.a.interface),
        ("algo-2", cluster.b.address, cluster.b.interface),
    ]
    params = artifact(info, "params.pt", tmp_path)
    for name, value in reference_global(world).items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5)  # type: ignore[index]
    job_dir = Path(info["JobFolder"])
    for rank in range(world):
        machine = (cluster.a, cluster.b)[rank // per_host]
        host = f"algo-{rank // per_host + 1}"
        folder = job_dir / "hosts" / host
        report = json.loads((folder / "output" / "data" / f"report-rank{rank}.json").read_text())
        env = report["env"]
        # Two hosts of two: reduce in the host first; of one: nothing to reduce in the host.
        assert report["hierarchical"] is (per_host > 1)
        assert env["SM_CURRENT_HOST"] == host and json.loads(env["SM_HOSTS"]) == [
            "algo-1", "algo-2",
        ]  # fmt: skip
        assert env["MASTER_ADDR"] == cluster.a.address
        assert env["SM_NETWORK_INTERFACE_NAME"] == machine.interface
        assert env["GLOO_SOCKET_IFNAME"] == machine.interface
        assert json.loads(env["SM_RESOURCE_CONFIG"])["network_interface_name"] == machine.interface
        assert env["SM_CHANNEL_TRAINING"] == str(folder / "input" / "data" / "training")
        assert env["SM_MODULE_DIR"] == str(folder / "code")
        assert json.loads(env["SM_TRAINING_ENV"])["current_host"] == host
    logs = dtrain("logs", job, "--rank", str(world - 1), home=cluster.home)
    assert logs.stdout.strip().endswith(f"rank {world - 1} done")
    assert processes_of_job(job) == []


def data_channel(tmp_path: Path) -> str:
    data = tmp_path / "data"
    data.mkdir()
    (data / "part-0").write_text("0")
    return f"training={data}"


def test_joined_agents_train_a_data_parallel_job_as_one_process_would(
    cluster: Cluster, tmp_path: Path
) -> None:
    controller = cluster.controller(
        "dp_train.py", "dp-joined", "--processes-per-host", "2",
        "--channel", data_channel(tmp_path),
    )  # fmt: skip
    cluster.agents()
    assert cluster.wait(controller) == 0, cluster.output("controller")[-3000:]
    assert (cluster.secret.stat().st_mode & 0o777) == 0o600
    assert cluster.describe("dp-joined")["Cluster"] == f"join://{cluster.join}"
    check_data_parallel_job(cluster, "dp-joined", tmp_path, per_host=2)


@pytest.fixture
def ray_head(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A lean Ray cluster: the head on the first machine, a worker node on the second; with
    Ray's token authentication on, as docs/clusters.md asks (the controller has the token)."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install ray: dtrain's ray extra)")
    marker = f"DTRAIN_TEST_RAY={os.getpid()}-{cluster.port}"
    scratch = Path(tempfile.mkdtemp(prefix="dtr", dir="/tmp"))  # Ray's socket paths are short
    token = scratch / "auth_token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    env = {
        **os.environ, "DTRAIN_HOME": str(cluster.home), "RAY_USAGE_STATS_ENABLED": "0",
        marker.split("=")[0]: marker.split("=")[1],
    }  # fmt: skip
    ray = str(Path(sys.executable).parent / "ray")
    # Nothing the job does not use: no log forwarding (the controller connects with
    # log_to_driver=False), no autoscaler.
    lean = [
        "--num-cpus", "1", "--object-store-memory", "200000000", "--disable-usage-stats",
        "--include-log-monitor", "false", "--block",
    ]  # fmt: skip
    gcs = f"{cluster.a.address}:{next(PORTS)}"
    head = ["--head", "--port", gcs.split(":")[1], "--include-dashboard=false", "--no-monitor"]
    nodes = []
    try:
        for machine, role in (
            (cluster.a, head),
            (cluster.b, ["--address", gcs]),
        ):
            log = scratch / f"{machine.namespace}.log"
            command = [ray, "start", *role, "--node-ip-address", machine.address,
                       "--temp-dir", str(scratch / machine.namespace), *lean]  # fmt: skip
            nodes.append(
                subprocess.Popen(
                    machine.command(command),
                    env=env,
                    stdout=log.open("w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            deadline = time.monotonic() + 60
            while "Ray runtime started" not in log.read_text():
                assert time.monotonic() < deadline and nodes[-1].poll() is None, log.read_text()
                time.sleep(0.2)
        yield f"ray://{gcs}"
    finally:
        for node in nodes:
            node.terminate()
        deadline = time.monotonic() + 10
        while marked_processes(marker.encode()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(3):  # a node that lost its head may not stop on SIGTERM
            signal_pids(marked_processes(marker.encode()), signal.SIGKILL)
            time.sleep(0.2)
        for node in nodes:
            node.wait()
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_ray_cluster_runs_the_same_job_one_agent_per_node(
    cluster: Cluster, ray_head: str, tmp_path: Path
) -> None:
    # One rank a host: the joined job above trains two a host; here what counts is the agents.
    controller = cluster.controller(
        "dp_train.py", "dp-ray", "--processes-per-host", "1",
        "--channel", data_channel(tmp_path), cluster=ray_head,
    )  # fmt: skip
    assert cluster.wait(controller) == 0, cluster.output("controller")[-3000:]
    assert cluster.describe("dp-ray")["Cluster"] == ray_head
    check_data_parallel_job(cluster, "dp-ray", tmp_path, per_host=1)
    too_big = cluster.start(
        cluster.a, "too-big", "run", "dp_train.py", "--source-dir", str(JOB_SCRIPTS),
        "--instance-count", "3", "--cluster", ray_head, "--job-name", "too-big",
    )  # fmt: skip
    assert too_big.wait(timeout=60) == 2
    assert "3 host(s) asked for, 2 node(s) alive" in cluster.output("too-big")


def test_a_pipeline_replica_per_machine_trains_as_one_process_would(
    cluster: Cluster, tmp_path: Path
) -> None:
    from tests.modelparallel.equivalence import reference

    distribution = {
        "smdistributed": {
            "modelparallel": {"enabled": True, "parameters": {"partitions": 2, "ddp": True}}
        },
        "mpi": {"enabled": True, "processes_per_host": 2},
    }
    controller = cluster.controller(
        "mp_train.py", "mp-joined", "--distribution", json.dumps(distribution)
    )
    cluster.agents()
    assert cluster.wait(controller, timeout=170) == 0, cluster.output("controller")[-3000:]
    trained = artifact(cluster.describe("mp-joined"), "trained.pt", tmp_path)
    expected = reference("lm", 3)
    for name, value in expected.params.items():
        torch.testing.assert_close(trained["params"][name], value, rtol=0, atol=1e-5)  # type: ignore[index]
    assert processes_of_job("mp-joined") == []


def test_a_rank_raising_on_the_second_machine_fails_the_job_within_seconds(
    cluster: Cluster,
) -> None:
    controller = cluster.controller(
        "raises.py", "raises-joined", "--processes-per-host", "1",
        "--environment", "FAILING_RANK=1",
    )  # fmt: skip
    cluster.agents()
    assert cluster.wait(controller) == 1
    info = cluster.describe("raises-joined")
    assert info["FailureReason"].startswith("rank 1 (algo-2) exited with code 1")
    assert info["FailureReason"].endswith("ValueError: boom from rank 1")
    logs = dtrain("logs", "raises-joined", "--rank", "1", home=cluster.home).stdout
    raised_at = float(logs.split("raising at ")[1].split()[0])
    ended_at = datetime.fromisoformat(info["TrainingEndTime"]).timestamp()
    assert ended_at - raised_at < 5, ended_at - raised_at
    failure = Path(info["JobFolder"]) / "hosts" / "algo-2" / "output" / "failure"
    assert "ValueError: boom from rank 1" in failure.read_text()
    assert processes_of_job("raises-joined") == []


def test_a_cut_link_is_found_by_heartbeat_and_both_machines_end_their_ranks(
    cluster: Cluster, machines: tuple[_netns.Host, _netns.Host]
) -> None:
    controller = cluster.controller("steps.py", "cut-link", "--processes-per-host", "1")
    cluster.agents()
    deadline = time.monotonic() + 60
    while "step 5" not in cluster.output("controller") and time.monotonic() < deadline:
        time.sleep(0.1)
    _netns.set_link(machines[1], up=False)
    try:
        cut = time.monotonic()
        assert cluster.wait(controller, timeout=60) == 1
        assert time.monotonic() - cut < 30
        reason = cluster.describe("cut-link")["FailureReason"]
        assert reason.startswith(f"host algo-2 ({machines[1].address}) was lost: no heartbeat")
        assert on_host("cut-link", "algo-1") == []
        deadline = time.monotonic() + 30  # the cut-off agent notices the silence itself
        while on_host("cut-link", "algo-2") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_of_job("cut-link") == []
    finally:
        _netns.set_link(machines[1], up=True)


def test_an_agent_killed_outright_takes_its_ranks_and_fails_the_job(cluster: Cluster) -> None:
    controller = cluster.controller("steps.py", "agent-killed", "--processes-per-host", "2")
    _, second = cluster.agents()
    deadline = time.monotonic() + 60
    while len(on_host("agent-killed", "algo-2")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    second.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    while on_host("agent-killed", "algo-2") and time.monotonic() - killed < 5:
        time.sleep(0.05)
    assert on_host("agent-killed", "algo-2") == []
    assert cluster.wait(controller, timeout=30) == 1
    reason = cluster.describe("agent-killed")["FailureReason"]
    assert reason.startswith("host algo-2") and "connection closed" in reason
    assert processes_of_job("agent-killed") == []


def test_a_retry_after_a_killed_rank_ends_as_an_uninterrupted_run(
    cluster: Cluster, tmp_path: Path
) -> None:
    from tests.dataparallel.scenarios import reference_global

    controller = cluster.controller(  # one rank a host: the retry crosses machines all the same
        "resumes.py", "retried-joined", "--processes-per-host", "1",
        "--max-retry-attempts", "1", "--environment", "KILLED_RANK=1",
        "--checkpoint-local-path", str(tmp_path / "checkpoints"),
    )  # fmt: skip
    cluster.agents()
    assert cluster.wait(controller) == 0, cluster.output("controller")[-3000:]
    info = cluster.describe("retried-joined")
    statuses = [t["Status"] for t in info["SecondaryStatusTransitions"]]
    assert statuses.count("Training") == 2 and "Restarting" in statuses
    params = artifact(info, "params.pt", tmp_path)
    for name, value in reference_global(2).items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5)  # type: ignore[index]
    first = dtrain("logs", "retried-joined", "--attempt", "1", home=cluster.home).stdout
    second = dtrain("logs", "retried-joined", "--attempt", "2", home=cluster.home).stdout
    assert "resumed" not in first and "[algo-1,0]: resumed after step 1" in second
    assert processes_of_job("retried-joined") == []

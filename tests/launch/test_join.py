"""Finding machines, on loopback: bad cluster input before launch, agents that cannot prove the
secret, hosts that never join, a flood of connections, a controller killed outright, an upload
interrupted."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import JOB_SCRIPTS, dtrain, processes_of_job

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def background(home: Path, log: Path, *args: str, **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", *args],
        env={**os.environ, "DTRAIN_HOME": str(home)},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def run_flags(name: str, *flags: str) -> list[str]:
    return [
        "run", "sleeps.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", name,
        "--instance-type", "local_cpu", *flags,
    ]  # fmt: skip


def describe(home: Path, name: str) -> dict:
    result = dtrain("describe", name, home=home)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--cluster", "lokal"], "did you mean 'local'"),
        (["--cluster", "join://head-node:29400", "--secret-file", "s"], "numeric IP address"),
        (["--cluster", "join://203.0.113.9:29400", "--secret-file", "s"], "not)"),
        (["--cluster", "join://127.0.0.1:29400"], "secret_file"),
        (["--secret-file", "s"], "only with a join:// cluster"),
        (["--cluster", "join://127.0.0.1:29400", "--secret-file", "s", "--join-timeout", "0"],
         "join_timeout"),
    ],
)  # fmt: skip
def test_bad_cluster_input_is_rejected_before_launch(
    dtrain_home: Path, flags: list[str], expected: str
) -> None:
    result = dtrain(*run_flags("bad-cluster", *flags), home=dtrain_home)
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert dtrain("describe", "bad-cluster", home=dtrain_home).returncode == 2  # no record


def test_a_busy_join_address_is_rejected_before_launch(dtrain_home: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        secret = str(tmp_path / "secret")
        flags = ["--cluster", f"join://127.0.0.1:{port}", "--secret-file", secret]
        result = dtrain(*run_flags("busy", *flags), home=dtrain_home)
    assert result.returncode == 2 and "free to listen on" in result.stderr, result.stderr
    assert dtrain("describe", "busy", home=dtrain_home).returncode == 2


def test_a_wrong_secret_and_a_stranger_are_refused_and_a_joined_agent_is_dismissed(
    dtrain_home: Path, tmp_path: Path
) -> None:
    """The join timeout is never reached: the job is stopped once the agent joined, however long
    the agents took to start."""
    port = free_port()
    secret, wrong = tmp_path / "secret", tmp_path / "wrong"
    wrong.write_text("x" * 64)
    wrong.chmod(0o600)
    flags = ["--cluster", f"join://127.0.0.1:{port}", "--secret-file", str(secret)]
    log = tmp_path / "controller.log"
    controller = background(
        dtrain_home, log,
        *run_flags("never-complete", "--instance-count", "2", "--join-timeout", "120", *flags),
    )  # fmt: skip
    try:
        wait_for_file(secret)
        join = ["agent", "--join", f"127.0.0.1:{port}"]
        impostor = dtrain(*join, "--secret-file", str(wrong), "--connect-timeout", "2",
                          home=dtrain_home)  # fmt: skip
        assert impostor.returncode != 0 and "wrong secret" in impostor.stderr, impostor.stderr
        stranger = dtrain(*join, "--secret-file", str(secret), "--host", "algo-7", home=dtrain_home)
        assert stranger.returncode == 1
        assert "refused this agent: host 'algo-7' is not a host of this job" in stranger.stderr
        agent = background(dtrain_home, tmp_path / "agent.log", *join, "--secret-file", str(secret))
        deadline = time.monotonic() + 60
        while "algo-1 joined" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        controller.send_signal(signal.SIGINT)
        assert controller.wait(timeout=60) == 3
        assert agent.wait(timeout=20) == 0  # dismissed: the job ended
    finally:
        for process in (controller, locals().get("agent")):
            if process is not None and process.poll() is None:
                process.kill()
    output = log.read_text()
    assert "refused a connection from 127.0.0.1" in output and "wrong secret" in output
    journal = Path(describe(dtrain_home, "never-complete")["JobFolder"]) / "logs/controller.log"
    assert "refused a connection from 127.0.0.1" in journal.read_text()
    assert "algo-1 joined: 127.0.0.1 (lo)" in output
    assert describe(dtrain_home, "never-complete")["TrainingJobStatus"] == "Stopped"


def test_hosts_that_never_join_fail_the_job_naming_them(dtrain_home: Path, tmp_path: Path) -> None:
    flags = ["--cluster", f"join://127.0.0.1:{free_port()}", "--secret-file", str(tmp_path / "s")]
    result = dtrain(
        *run_flags("nobody-came", "--instance-count", "2", "--join-timeout", "1", *flags),
        home=dtrain_home,
    )
    assert result.returncode == 1, result.stderr
    reason = describe(dtrain_home, "nobody-came")["FailureReason"]
    assert reason == "host(s) algo-1, algo-2 did not join within 1 s"


def wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_flood_of_connections_neither_crashes_the_controller_nor_keeps_an_agent_out(
    dtrain_home: Path, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "train.py").write_text("print('trained')\n")
    port, secret = free_port(), tmp_path / "secret"
    controller = background(
        dtrain_home, tmp_path / "controller.log",
        "run", "train.py", "--source-dir", str(source), "--job-name", "flooded",
        "--instance-type", "local_cpu", "--cluster", f"join://127.0.0.1:{port}",
        "--secret-file", str(secret),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)),
    )  # fmt: skip
    try:
        wait_for_file(secret)  # written once the controller listens
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        time.sleep(1)  # held while the controller takes them in: more than its descriptors
        for connection in flood:
            connection.close()
        agent = dtrain("agent", "--join", f"127.0.0.1:{port}", "--secret-file", str(secret),
                       "--connect-timeout", "30", home=dtrain_home)  # fmt: skip
        assert agent.returncode == 0, agent.stderr
        assert controller.wait(timeout=60) == 0
    finally:
        if controller.poll() is None:
            controller.kill()
    output = (tmp_path / "controller.log").read_text()
    assert "connections from 127.0.0.1 await a first frame" in output
    assert "[algo-1,0]: trained" in output
    assert describe(dtrain_home, "flooded")["TrainingJobStatus"] == "Completed"


def test_a_controller_killed_outright_leaves_no_rank_running(
    dtrain_home: Path, tmp_path: Path
) -> None:
    controller = background(
        dtrain_home, tmp_path / "controller.log", *run_flags("orphaned", "--instance-count", "2")
    )
    deadline = time.monotonic() + 60
    while len(processes_of_job("orphaned")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(processes_of_job("orphaned")) >= 2
    controller.send_signal(signal.SIGKILL)
    controller.wait()
    killed = time.monotonic()
    while processes_of_job("orphaned") and time.monotonic() - killed < 5:
        time.sleep(0.05)
    assert processes_of_job("orphaned") == []
    info = describe(dtrain_home, "orphaned")
    assert info["TrainingJobStatus"] == "Failed"
    assert "exited without finishing" in info["FailureReason"]


BIG_MODEL = """
import os
from pathlib import Path
if os.environ["RANK"] == "0":
    Path(os.environ["SM_MODEL_DIR"], "big.bin").write_bytes(os.urandom(300 * 2**20))
"""


def test_an_interrupted_upload_leaves_no_archive_at_its_final_path(
    dtrain_home: Path, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "big.py").write_text(BIG_MODEL)
    output = tmp_path / "output"
    controller = background(
        dtrain_home, tmp_path / "controller.log",
        "run", "big.py", "--source-dir", str(source), "--job-name", "interrupted",
        "--instance-type", "local_cpu", "--output-path", str(output),
    )  # fmt: skip
    final = output / "interrupted" / "output" / "model.tar.gz"
    deadline = time.monotonic() + 60
    while not list(final.parent.glob("model.tar.gz.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    controller.send_signal(signal.SIGINT)
    assert controller.wait(timeout=60) == 3
    assert not final.exists() and list(final.parent.iterdir()) == []
    info = describe(dtrain_home, "interrupted")
    assert info["TrainingJobStatus"] == "Stopped"
    assert info["ModelArtifacts"]["S3ModelArtifacts"] is None
    assert processes_of_job("interrupted") == []


def test_a_lost_host_is_replaced_for_the_retry(dtrain_home: Path, tmp_path: Path) -> None:
    controller = background(
        dtrain_home, tmp_path / "controller.log",
        "run", "lost_once.py", "--source-dir", str(JOB_SCRIPTS), "--job-name", "replaced",
        "--instance-type", "local_cpu", "--instance-count", "2", "--max-retry-attempts", "1",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(processes_of_job("replaced")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    first = describe(dtrain_home, "replaced")["Hosts"]
    os.kill(first[1]["AgentPid"], signal.SIGKILL)
    assert controller.wait(timeout=90) == 0, (tmp_path / "controller.log").read_text()[-3000:]
    info = describe(dtrain_home, "replaced")
    statuses = [t["Status"] for t in info["SecondaryStatusTransitions"]]
    assert statuses.count("Training") == 2 and "Restarting" in statuses
    assert info["Hosts"][0]["AgentPid"] == first[0]["AgentPid"]  # the survivor stayed
    assert info["Hosts"][1]["AgentPid"] != first[1]["AgentPid"]
    logs = dtrain("logs", "replaced", "--attempt", "2", home=dtrain_home).stdout
    assert "[algo-2,1]: attempt 2 on algo-2" in logs
    assert processes_of_job("replaced") == []

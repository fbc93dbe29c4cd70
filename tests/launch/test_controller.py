"""The controller's phases against fake agents that speak the protocol over loopback: hosts named
as they join, an attempt's end and its root cause, a silent host lost, an agent's error shown
harmless."""

from __future__ import annotations

import io
import socket
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dtrain.config.distribution import resolve_distribution
from dtrain.errors import DtrainError
from dtrain.jobs.spec import JobSpec
from dtrain.launch import controller as controller_module
from dtrain.launch import links
from dtrain.launch.controller import Controller, JobStopped
from dtrain.launch.env import LaunchPlan
from dtrain.launch.outcome import COMPLETED, FAILED, Attempt, Outcome
from dtrain.launch.transfer import CHUNK, send_folder
from dtrain.launch.wire import Connection, ConnectionClosed, Message
from tests.launch.peers import SECRET, FakeAgent


class NoEngine:
    def lost(self) -> list[tuple[str, str]]:
        return []


@pytest.fixture
def controller(tmp_path: Path) -> tuple[Controller, list[tuple[str, int, list[str]]]]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    output: list[tuple[str, int, list[str]]] = []
    said: list[str] = []
    started = Controller(
        listener, SECRET, NoEngine(),
        lambda h, a, r, lines, frame: output.append((h, r, [line for _, line in lines])),
        said.append, lambda: None,
    )  # fmt: skip
    yield started, output
    started.close()


def plan(hosts: list) -> LaunchPlan:
    spec = JobSpec(
        "train.py", "job", instance_count=2, instance_type="local_cpu", key_salt="0" * 32
    )
    distribution = resolve_distribution(
        None, instance_count=2, processes_per_host=1, default_processes_per_host=1
    )
    return LaunchPlan(spec, distribution, tuple(hosts))


def port_of(controller: Controller) -> int:
    return controller.links.listener.getsockname()[1]


def ignore(*anything: object) -> None:
    return None


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_hosts_are_named_as_asked_then_in_order_and_extras_refused(
    controller: tuple, tmp_path: Path
) -> None:
    control, _ = controller
    FakeAgent(port_of(control), "algo-2", ignore, tmp_path)
    FakeAgent(port_of(control), None, ignore, tmp_path)
    hosts = control.gather(["algo-1", "algo-2"], timeout=10)
    assert [host.name for host in hosts] == ["algo-1", "algo-2"]
    with pytest.raises(ConnectionClosed):  # no host is awaited: turned away at once
        FakeAgent(port_of(control), None, ignore, tmp_path)


def first_rank_fails(
    control: Controller, home: Path, lines: list[str], tail: str, frame: str | None = None
) -> tuple[Outcome, FakeAgent]:
    """An attempt on two hosts whose rank 0 writes ``lines`` (and ``frame``) and fails with
    ``tail``, and whose other rank ends when stopped; its outcome, and the other host."""

    def failing(agent: FakeAgent, message: Message) -> None:
        if message.kind == "start":
            stamped = [[0, line] for line in lines]
            agent.connection.send("output", attempt=1, rank=0, lines=stamped, frame=frame)
            agent.exited(1, 0, 1, tail)
            agent.connection.send("done", attempt=1)

    def waiting(agent: FakeAgent, message: Message) -> None:
        if message.kind == "stop":
            agent.exited(1, 1, -15)
            agent.connection.send("done", attempt=1)

    FakeAgent(port_of(control), "algo-1", failing, home)
    second = FakeAgent(port_of(control), "algo-2", waiting, home)
    hosts = control.gather(["algo-1", "algo-2"], timeout=10)
    return control.run_attempt(Attempt(1, ("algo-1", "algo-2")), plan(hosts), 1234), second


def test_the_first_failure_stops_the_other_host_and_names_the_root_cause(
    controller: tuple, tmp_path: Path
) -> None:
    control, output = controller
    tail = "Traceback (most recent call last):\nValueError: boom"
    outcome, second = first_rank_fails(control, tmp_path, ["step 0", "Traceback"], tail)
    assert outcome.status == FAILED
    assert outcome.message == "rank 0 (algo-1) exited with code 1: ValueError: boom"
    assert second.orders == ["start", "stop"]
    assert output == [("algo-1", 0, ["step 0", "Traceback"])]


def test_a_silent_host_is_lost(
    controller: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(links, "SILENCE_LIMIT", 0.5)
    monkeypatch.setattr(links, "HEARTBEAT_INTERVAL", 0.1)
    control, _ = controller

    def goes_silent(agent: FakeAgent, message: Message) -> None:
        if message.kind == "start":
            agent.silent = True

    def obeys(agent: FakeAgent, message: Message) -> None:
        if message.kind == "stop":
            agent.exited(1, 0, -15)
            agent.connection.send("done", attempt=1)

    FakeAgent(port_of(control), "algo-1", obeys, tmp_path)
    FakeAgent(port_of(control), "algo-2", goes_silent, tmp_path)
    hosts = control.gather(["algo-1", "algo-2"], timeout=10)
    started = time.monotonic()
    outcome = control.run_attempt(Attempt(1, ("algo-1", "algo-2")), plan(hosts), 1234)
    assert time.monotonic() - started < 5
    assert outcome.status == FAILED and outcome.retryable
    assert outcome.message == "host algo-2 (127.0.0.1) was lost: no heartbeat for 0.5 s " + (
        "(its machine or the network is down)"
    )
    assert control.lost_hosts() == ["algo-2"]


def test_every_rank_done_completes_the_attempt(controller: tuple, tmp_path: Path) -> None:
    control, _ = controller

    def succeeds(agent: FakeAgent, message: Message) -> None:
        if message.kind == "start":
            rank = int(next(iter(message["ranks"])))
            agent.exited(1, rank, 0)
            agent.connection.send("done", attempt=1)

    FakeAgent(port_of(control), None, succeeds, tmp_path)
    FakeAgent(port_of(control), None, succeeds, tmp_path)
    hosts = control.gather(["algo-1", "algo-2"], timeout=10)
    outcome = control.run_attempt(Attempt(1, ("algo-1", "algo-2")), plan(hosts), 1234)
    assert outcome.status == COMPLETED


def test_an_agents_error_is_shown_escaped(controller: tuple, tmp_path: Path) -> None:
    control, _ = controller

    def fails(agent: FakeAgent, message: Message) -> None:
        if message.kind == "open_store":
            agent.connection.send("error", message="boom\n\x1b[31mFAKE")

    FakeAgent(port_of(control), "algo-1", fails, tmp_path)
    FakeAgent(port_of(control), "algo-2", ignore, tmp_path)
    control.gather(["algo-1", "algo-2"], timeout=10)
    with pytest.raises(DtrainError) as raised:
        control.open_store(1, "algo-1")
    assert str(raised.value) == "opening the rendezvous store: algo-1: boom\\n\\x1b[31mFAKE"


def code_of(megabytes: int, to: Callable[[Connection], bool] = lambda connection: True) -> Any:
    """A code stream of ``megabytes`` (more than the sockets of a host that reads nothing hold)
    to the hosts whose connection is ``to``; an empty one to the others."""

    def send(connection: Connection, check: Callable[[], None] = lambda: None) -> None:
        for _ in range(megabytes if to(connection) else 0):
            check()
            connection.send("chunk", b"\0" * CHUNK, stream="code")
        connection.send("end", stream="code")

    return send


def in_thread(call: Callable[[], object], timeout: float) -> BaseException | None:
    """What ``call`` raised (None: nothing) within ``timeout``; a call still waiting fails."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            raised.append(None)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert raised, f"still waiting after {timeout:g} s"
    return raised[0]


def test_a_host_that_stops_reading_is_lost_and_the_others_hear_their_heartbeats(
    controller: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen host (SIGSTOP on its agent keeps its connection at a zero window) while it is
    sent the job's code: the stuck send ends once the host is found silent, the phase fails
    naming it, and the heartbeats of the healthy host never waited behind the stuck send."""
    monkeypatch.setattr(links, "SILENCE_LIMIT", 1.5)
    monkeypatch.setattr(links, "HEARTBEAT_INTERVAL", 0.1)
    control, _ = controller
    frozen = threading.Event()
    heard: list[int] = []

    def freezes(agent: FakeAgent, message: Message) -> None:
        if message.kind == "prepare":
            agent.silent = True
            heard.append(healthy.heartbeats)
            frozen.wait()  # reads nothing more

    def prepares(agent: FakeAgent, message: Message) -> None:
        if message.kind == "end":
            agent.connection.send("prepared")

    healthy = FakeAgent(port_of(control), "algo-1", prepares, tmp_path)
    FakeAgent(port_of(control), "algo-2", freezes, tmp_path)
    hosts = control.gather(["algo-1", "algo-2"], timeout=10)
    started = time.monotonic()
    code = code_of(64, to=lambda connection: connection is control.hosts["algo-2"].connection)
    error = in_thread(lambda: control.prepare(plan(hosts), code), timeout=30)
    assert str(error) == (
        "laying out the hosts: host algo-2 (127.0.0.1) was lost: no heartbeat for 1.5 s "
        "(its machine or the network is down)"
    )
    assert time.monotonic() - started < 10
    assert healthy.heartbeats - heard[0] >= 3  # a tenth of a second apart while algo-2 was stuck
    control.close()
    wait_until(lambda: "bye" in healthy.orders)  # the healthy host is dismissed
    frozen.set()


def never_sends(agent: FakeAgent, message: Message) -> None:
    return None  # it heartbeats, but sends nothing it is asked for


def test_a_host_that_never_sends_a_requested_folder_times_out_and_a_stop_ends_the_wait(
    controller: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controller_module, "SILENCE_LIMIT", 1.0)
    control, _ = controller
    FakeAgent(port_of(control), "algo-1", never_sends, tmp_path)
    control.gather(["algo-1"], timeout=10)
    error = in_thread(
        lambda: control.fetch("tensorboard", "algo-1", tmp_path / "tb", lambda: None), timeout=20
    )
    assert str(
        error
    ) == "cannot collect tensorboard/ from algo-1: its agent sent nothing of it " + ("for 1 s")
    monkeypatch.setattr(controller_module, "SILENCE_LIMIT", 600.0)
    stop = threading.Event()

    def check() -> None:
        if stop.is_set():
            raise JobStopped("Stopped", "Stopped by request (dtrain stop)")

    threading.Timer(0.5, stop.set).start()
    with tarfile.open(fileobj=io.BytesIO(), mode="w") as target:
        error = in_thread(lambda: control.collect("model", ["algo-1"], target, check), timeout=20)
    assert isinstance(error, JobStopped) and str(error) == "Stopped by request (dtrain stop)"


def test_links_in_a_tensorboard_folder_are_skipped_and_never_cost_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed TensorBoard copy of a link used to leave the rest of its stream in flight for
    the model's collection to read: a TensorBoard folder whose link comes first, then far more
    than the controller's reader holds."""
    tensorboard, model = tmp_path / "tensorboard", tmp_path / "model"
    tensorboard.mkdir()
    (tensorboard / "0-vocab").symlink_to("/usr/share")
    (tensorboard / "events").write_bytes(b"e" * (40 * CHUNK))
    model.mkdir()
    (model / "model.pt").write_text("weights")

    def sends(agent: FakeAgent, message: Message) -> None:
        if message.kind == "send":
            folder = tensorboard if message["stream"] == "tensorboard" else model
            send_folder(agent.connection, message["stream"], folder)

    listener = socket.create_server(("127.0.0.1", 0))
    said: list[str] = []
    control = Controller(listener, SECRET, NoEngine(), ignore, said.append, lambda: None)
    try:
        FakeAgent(port_of(control), "algo-1", sends, tmp_path)
        control.gather(["algo-1"], timeout=10)
        collected = tmp_path / "collected"
        tensorboard_error = in_thread(
            lambda: control.fetch("tensorboard", "algo-1", collected, lambda: None), timeout=30
        )
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as target:
            collect = lambda: control.collect("model", ["algo-1"], target, lambda: None)  # noqa: E731
            assert in_thread(collect, timeout=30) is None  # as the job goes on after TensorBoard
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            assert tar.extractfile("model.pt").read() == b"weights"  # type: ignore[union-attr]
        assert tensorboard_error is None
        assert said[-1] == "tensorboard/0-vocab of algo-1 not collected: a link to '/usr/share'"
        assert (collected / "events").stat().st_size == 40 * CHUNK
    finally:
        control.close()


def test_an_agents_output_and_a_failed_ranks_tail_reach_the_controller_escaped(
    controller: tuple, tmp_path: Path
) -> None:
    control, output = controller
    forged = "step 1\n[dtrain job 00:00:09] Completed: Training job completed\x1b[2J"
    tail = "Traceback (most recent call last):\nValueError: x\x1b[31m\r\n"
    outcome, _ = first_rank_fails(control, tmp_path, [forged], tail, frame="50%\x1b[A")
    assert output == [("algo-1", 0, [forged.replace("\n", "\\n").replace("\x1b", "\\x1b")])]
    assert outcome.message == "rank 0 (algo-1) exited with code 1: ValueError: x\\x1b[31m"
    assert outcome.failure is not None and "\x1b" not in outcome.failure.tail

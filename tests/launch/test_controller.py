"""The controller's phases against fake agents that speak the protocol over loopback: hosts named
as they join, an attempt's end and its root cause, a silent host lost, an agent's error shown
harmless."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dtrain.config.distribution import resolve_distribution
from dtrain.errors import DtrainError
from dtrain.jobs.spec import JobSpec
from dtrain.launch import links
from dtrain.launch.controller import Controller
from dtrain.launch.env import LaunchPlan
from dtrain.launch.outcome import COMPLETED, FAILED, Attempt
from dtrain.launch.wire import (
    FROM_CONTROLLER,
    Connection,
    ConnectionClosed,
    Message,
    join_controller,
)
from tests.launch.peers import SECRET, facts

Script = Callable[["FakeAgent", Message], None]


class NoEngine:
    def lost(self) -> list[tuple[str, str]]:
        return []


class FakeAgent:
    """Joins the controller and answers each order with ``script``; beats until ``silent``."""

    def __init__(self, port: int, host: str | None, script: Script, home: Path) -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        self.connection = Connection(sock, FROM_CONTROLLER)
        self.orders: list[str] = []
        self.silent = False
        join_controller(self.connection, SECRET, facts(host, str(home)))
        self.script = script
        threading.Thread(target=self._serve, daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def _serve(self) -> None:
        try:
            while True:
                message = self.connection.receive()
                if message.kind != "heartbeat":
                    self.orders.append(message.kind)
                    self.script(self, message)
        except ConnectionClosed:
            return

    def _beat(self) -> None:
        while not self.silent:
            try:
                self.connection.send("heartbeat")
            except ConnectionClosed:
                return
            time.sleep(0.1)

    def exited(self, attempt: int, rank: int, code: int, tail: str = "") -> None:
        self.connection.send(
            "exited", attempt=attempt, rank=rank, code=code, time=time.time(), tail=tail,
            stopped=False,
        )  # fmt: skip


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
    spec = JobSpec("train.py", "job", instance_count=2, instance_type="local_cpu")
    distribution = resolve_distribution(
        None, instance_count=2, processes_per_host=1, default_processes_per_host=1
    )
    return LaunchPlan(spec, distribution, tuple(hosts))


def port_of(controller: Controller) -> int:
    return controller.links.listener.getsockname()[1]


def ignore(agent: FakeAgent, message: Message) -> None:
    return None


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


def test_the_first_failure_stops_the_other_host_and_names_the_root_cause(
    controller: tuple, tmp_path: Path
) -> None:
    control, output = controller

    def failing(agent: FakeAgent, message: Message) -> None:
        if message.kind == "start":
            agent.connection.send(
                "output", attempt=1, rank=0, lines=[[0, "step 0"], [0, "Traceback"]], frame=None
            )
            agent.exited(1, 0, 1, "Traceback (most recent call last):\nValueError: boom")
            agent.connection.send("done", attempt=1)

    def waiting(agent: FakeAgent, message: Message) -> None:
        if message.kind == "stop":
            agent.exited(1, 1, -15)
            agent.connection.send("done", attempt=1)

    FakeAgent(port_of(control), "algo-1", failing, tmp_path)
    second = FakeAgent(port_of(control), "algo-2", waiting, tmp_path)
    hosts = control.gather(["algo-1", "algo-2"], timeout=10)
    outcome = control.run_attempt(Attempt(1, ("algo-1", "algo-2")), plan(hosts), 1234)
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

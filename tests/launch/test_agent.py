"""An agent over loopback without processes: whatever ends it unexpectedly reaches the controller
as an error naming it, escaped, before the agent goes; the rendezvous store it hosts lives only as
long as its attempt."""

from __future__ import annotations

import io
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dtrain.jobs.folder import HostFolder
from dtrain.launch import agent as agent_module
from dtrain.launch.agent import Agent
from dtrain.launch.wire import ProtocolError
from tests.launch.peers import SECRET, admitted_pair

pytestmark = pytest.mark.timeout(60)


def broken_send_folder(*args: Any) -> None:
    raise OSError("disk gone\n\x1b[31mFAKE")


@pytest.mark.parametrize(
    ("order", "failure", "told"),
    [
        (
            {"kind": "send", "stream": "model"},
            OSError,
            r"its agent failed: OSError: disk gone\\n\\x1b\[31mFAKE$",
        ),
        (
            {"kind": "stop", "attempt": "1"},
            ProtocolError,
            r"its agent failed: ProtocolError: 127\.0\.0\.1:\d+ sent 'stop' with attempt = '1'",
        ),
    ],
    ids=["error", "bad order"],
)
def test_an_agent_that_fails_tells_the_controller_why_before_it_goes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    order: dict[str, Any],
    failure: type[Exception],
    told: str,
) -> None:
    monkeypatch.setattr(agent_module, "send_folder", broken_send_folder)
    controller, end = admitted_pair()
    agent = Agent(end, lambda line: None, "marker", os.getpid(), SECRET)
    agent.folder = HostFolder(tmp_path)
    controller.send(**order)
    with pytest.raises(failure):
        agent.serve()
    message = controller.receive()
    while message.kind == "heartbeat":
        message = controller.receive()
    assert message.kind == "error" and re.match(told, message["message"]), message


class _Controller:
    """The agent's side of its connection: a bound socket for its address, and what it sent."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, kind: str, payload: bytes = b"", **fields: Any) -> None:
        self.sent.append((kind, fields))


def test_the_store_closes_when_the_attempt_ends() -> None:
    controller = _Controller()
    agent = Agent(controller, print, "marker", 0, b"secret")  # type: ignore[arg-type]
    agent._handle("open_store", {"attempt": 1})
    (kind, fields), *_ = controller.sent
    assert (kind, fields["attempt"]) == ("store", 1)
    socket.create_connection(("127.0.0.1", fields["port"]), timeout=5).close()
    agent._handle("close_store", {"attempt": 1})
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", fields["port"]), timeout=5)
    controller.sock.close()


class _Started:
    """What ``spawn_agent`` started: its command, and what it wrote to the agent's input."""

    def __init__(self, command: list[str], **options: Any) -> None:
        self.command = command
        self.stdin = self
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        pass


def test_dtrain_starts_an_agent_as_its_own_module_with_the_flags_it_parses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Local and Ray hosts start ``python -m dtrain.launch.agent`` (not ``dtrain.cli``, which
    sits above the launcher); what it passes is what the module's ``main`` parses."""
    monkeypatch.setattr(agent_module.subprocess, "Popen", _Started)
    started: Any = agent_module.spawn_agent(("127.0.0.1", 29400), SECRET, "algo-2", 5.0)
    assert started.command[:3] == [sys.executable, "-m", "dtrain.launch.agent"]
    joined: list[tuple[Any, ...]] = []
    monkeypatch.setattr(agent_module, "run_agent", lambda *args: joined.append(args) or 7)
    monkeypatch.setattr(sys, "stdin", io.StringIO(started.written.decode()))

    def end(status: int) -> None:
        raise SystemExit(status)

    monkeypatch.setattr(agent_module.entry, "end", end)
    with pytest.raises(SystemExit) as ended:
        agent_module.main(started.command[3:])
    assert ended.value.code == 7
    assert joined == [(("127.0.0.1", 29400), SECRET, None, "algo-2", 5.0)]


def serving(agent: Agent) -> tuple[threading.Thread, list[int]]:
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(agent.serve()), daemon=True)
    thread.start()
    return thread, status


def test_an_agent_whose_controller_freezes_while_it_sends_its_model_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_module, "SILENCE_LIMIT", 1.0)
    controller, end = admitted_pair()
    said: list[str] = []
    agent = Agent(end, said.append, "marker", os.getpid(), SECRET)
    agent.folder = HostFolder(tmp_path)
    agent.folder.model_dir.mkdir(parents=True)
    (agent.folder.model_dir / "model.pt").write_bytes(b"\0" * (64 << 20))
    controller.send("send", stream="model")  # then it reads and sends nothing: frozen
    thread, status = serving(agent)
    thread.join(timeout=20)
    assert status == [1]
    assert said == [
        "lost the controller (no word from the controller for 1 s); stopping this "
        + ("host's ranks")
    ]
    controller.close()


def test_an_agent_waits_on_a_controller_slow_to_take_its_model_while_it_hears_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow upload holds the host's stream back; heartbeats say the controller lives."""
    monkeypatch.setattr(agent_module, "SILENCE_LIMIT", 1.5)
    controller, end = admitted_pair()
    agent = Agent(end, lambda line: None, "marker", os.getpid(), SECRET)
    agent.folder = HostFolder(tmp_path)
    agent.folder.model_dir.mkdir(parents=True)
    (agent.folder.model_dir / "model.pt").write_bytes(b"\0" * (64 << 20))
    controller.send("send", stream="model")
    thread, status = serving(agent)
    slow_until = time.monotonic() + 3.5  # more than twice the silence limit: nothing taken
    while time.monotonic() < slow_until:
        controller.send("heartbeat")
        time.sleep(0.1)
    received = 0
    while (message := controller.receive()).kind != "end":
        received += len(message.payload)
    controller.send("bye")
    thread.join(timeout=20)
    assert status == [0] and received > 64 << 20

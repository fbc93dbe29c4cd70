"""The rendezvous store an agent hosts lives only as long as its attempt."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from dtrain.launch.agent import Agent


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

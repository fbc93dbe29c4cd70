"""Both ends of the controller-agent protocol over loopback TCP, for tests without processes."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtrain.launch.handshake import admit_agent, join_controller
from dtrain.launch.wire import FROM_AGENT, FROM_CONTROLLER, Connection, ConnectionClosed, Message

SECRET = b"k" * 64


def facts(host: str | None = None, home: str = "/nowhere") -> dict[str, Any]:
    """What a fake agent tells about its machine."""
    return {
        "address": "127.0.0.1", "interface": "lo", "machine": "m", "hostname": "fake", "cpus": 2,
        "gpus": [], "home": home, "pid": 1, "host": host,
    }  # fmt: skip


def tcp_pair() -> tuple[Connection, Connection]:
    """The controller's and the agent's end of one connection, before the handshake."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        agent = socket.create_connection(server.getsockname())
        controller, _ = server.accept()
    return Connection(controller, FROM_AGENT), Connection(agent, FROM_CONTROLLER)


def admitted_pair() -> tuple[Connection, Connection]:
    """Both ends after the handshake: every frame from now on is sealed."""
    controller, agent = tcp_pair()
    joining = threading.Thread(target=join_controller, args=(agent, SECRET, facts()))
    joining.start()
    admit_agent(controller, SECRET)
    joining.join()
    return controller, agent


def raw_frame(fields: dict[str, Any] | bytes) -> bytes:
    """A frame as a stranger would write it: no seal, any body."""
    body = fields if isinstance(fields, bytes) else json.dumps(fields).encode()
    return struct.pack("!II", len(body), 0) + body


def read_frame(sock: socket.socket, sealed: bool = True) -> bytes:
    """One frame off the wire, as someone on the path sees it."""
    header = _read_exactly(sock, 8)
    body_size, payload_size = struct.unpack("!II", header)
    return header + _read_exactly(sock, body_size + payload_size + (16 if sealed else 0))


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the connection closed mid-frame"
        data += chunk
    return data


Script = Callable[["FakeAgent", Message], None]


class FakeAgent:
    """Joins the controller and answers each order with ``script``; beats until ``silent``;
    counts the controller's heartbeats."""

    def __init__(
        self,
        port: int,
        host: str | None,
        script: Script,
        home: Path,
        secret: bytes = SECRET,
        **told: Any,
    ) -> None:
        """``told``: facts of its machine other than :func:`facts`' (``hostname``, ``cpus``)."""
        sock = socket.create_connection(("127.0.0.1", port))
        self.connection = Connection(sock, FROM_CONTROLLER)
        self.orders: list[str] = []
        self.heartbeats = 0
        self.silent = False
        join_controller(self.connection, secret, {**facts(host, str(home)), **told})
        self.script = script
        threading.Thread(target=self._serve, daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def _serve(self) -> None:
        try:
            while True:
                message = self.connection.receive()
                if message.kind == "heartbeat":
                    self.heartbeats += 1
                else:
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

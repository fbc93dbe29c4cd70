"""Both ends of the controller-agent protocol over loopback TCP, for tests without processes."""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Any

from dtrain.launch.wire import (
    FROM_AGENT,
    FROM_CONTROLLER,
    Connection,
    admit_agent,
    join_controller,
)

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

"""Messages between a job's controller and its host agents, and the handshake that admits an agent.

A message is a JSON object (its ``kind`` and fields) and an optional binary payload, framed by two
lengths. Nothing is ever unpickled: a peer can send only data. Both sides prove the job's secret
with an HMAC of the other's random nonce before anything else is exchanged, so an agent takes
orders only from its job's controller and the controller admits only its job's agents; the
handshake's frames are capped small, so a stranger cannot make either side allocate much.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import struct
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError, DtrainError
from dtrain.launch.netif import format_endpoint

PROTOCOL_VERSION = 1
_HEADER = struct.Struct("!II")  # lengths of the JSON fields and of the payload
MESSAGE_LIMIT = 64 * 1024 * 1024
"""Largest frame part accepted from an admitted peer."""
HANDSHAKE_LIMIT = 16 * 1024
"""Largest frame part accepted before the peer proved the secret."""
HANDSHAKE_TIMEOUT = 10.0
HEARTBEAT_INTERVAL = 1.0
SILENCE_LIMIT = 15.0
"""A peer unheard of for this long is gone (a dead machine, a cut link); heartbeats go both ways
every second."""
SECRET_BYTES = 32


class ConnectionClosed(Exception):
    """The peer closed the connection, or it broke."""


class ProtocolError(Exception):
    """The peer sent something that is not a message of this protocol."""


class AuthenticationError(DtrainError):
    """The peer could not prove the job's secret."""


@dataclass(frozen=True)
class Message:
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


class Connection:
    """Whole messages over one socket; sends from several threads go out one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        try:
            address = sock.getpeername()
        except OSError:
            address = None
        self.peer = format_endpoint(*address[:2]) if isinstance(address, tuple) else "a local peer"

    def send(self, kind: str, payload: bytes = b"", **fields: Any) -> None:
        body = json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()
        frame = _HEADER.pack(len(body), len(payload)) + body
        try:
            with self._send_lock:
                self.sock.sendall(frame)
                if payload:
                    self.sock.sendall(payload)
        except OSError as error:
            raise ConnectionClosed(f"send to {self.peer} failed: {error}") from None

    def receive(self, limit: int = MESSAGE_LIMIT) -> Message:
        header = self._read(_HEADER.size)
        body_size, payload_size = _HEADER.unpack(header)
        if body_size > limit or payload_size > limit:
            raise ProtocolError(f"{self.peer} sent a frame over {limit} bytes")
        try:
            fields = json.loads(self._read(body_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ProtocolError(f"{self.peer} sent a frame that is not JSON: {error}") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("kind"), str):
            raise ProtocolError(f"{self.peer} sent a frame without a kind")
        kind = fields.pop("kind")
        payload = self._read(payload_size) if payload_size else b""
        return Message(kind, fields, payload)

    def expect(self, kind: str, limit: int = MESSAGE_LIMIT) -> Message:
        message = self.receive(limit)
        if message.kind == "error":
            raise ProtocolError(f"{self.peer}: {message.fields.get('message')}")
        if message.kind != kind:
            raise ProtocolError(f"{self.peer} sent {message.kind!r} where {kind!r} was due")
        return message

    def _read(self, size: int) -> bytes:
        buffer = bytearray(size)
        view = memoryview(buffer)
        done = 0
        while done < size:
            try:
                received = self.sock.recv_into(view[done:], size - done)
            except TimeoutError:
                raise ConnectionClosed(f"{self.peer} went silent mid-message") from None
            except OSError as error:
                raise ConnectionClosed(f"receive from {self.peer} failed: {error}") from None
            if received == 0:
                raise ConnectionClosed(f"{self.peer} closed the connection")
            done += received
        return bytes(buffer)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def prove(secret: bytes, role: str, nonce: str) -> str:
    """The proof that ``role`` holds the secret, over the nonce the other side chose."""
    return hmac.new(
        secret, f"dtrain/{PROTOCOL_VERSION}/{role}/{nonce}".encode(), hashlib.sha256
    ).hexdigest()


def admit_agent(connection: Connection, secret: bytes) -> Message:
    """Controller side: challenge a new connection; its ``hello`` once it proved the secret."""
    nonce = secrets.token_hex(16)
    connection.sock.settimeout(HANDSHAKE_TIMEOUT)
    connection.send("challenge", nonce=nonce, version=PROTOCOL_VERSION)
    hello = connection.expect("hello", limit=HANDSHAKE_LIMIT)
    proof = hello.fields.get("proof")
    if hello.fields.get("version") != PROTOCOL_VERSION:
        raise AuthenticationError(
            f"protocol version {hello.fields.get('version')!r}, not {PROTOCOL_VERSION}"
        )
    if not isinstance(proof, str) or not hmac.compare_digest(proof, prove(secret, "agent", nonce)):
        raise AuthenticationError("wrong secret")
    agent_nonce = hello.fields.get("nonce")
    if not isinstance(agent_nonce, str) or len(agent_nonce) < 16:
        raise AuthenticationError("no nonce to answer")
    connection.send("welcome", proof=prove(secret, "controller", agent_nonce))
    connection.sock.settimeout(None)
    return hello


def join_controller(connection: Connection, secret: bytes, **facts: Any) -> None:
    """Agent side: answer the controller's challenge with ``facts`` and check its own proof."""
    connection.sock.settimeout(HANDSHAKE_TIMEOUT)
    challenge = connection.expect("challenge", limit=HANDSHAKE_LIMIT)
    if challenge.fields.get("version") != PROTOCOL_VERSION:
        raise AuthenticationError(
            f"the controller speaks protocol {challenge.fields.get('version')!r}, this agent "
            f"{PROTOCOL_VERSION}: install the same dtrain version on every machine"
        )
    nonce = secrets.token_hex(16)
    connection.send(
        "hello",
        version=PROTOCOL_VERSION,
        nonce=nonce,
        proof=prove(secret, "agent", str(challenge["nonce"])),
        **facts,
    )
    try:
        welcome = connection.expect("welcome", limit=HANDSHAKE_LIMIT)
    except ConnectionClosed:
        raise AuthenticationError(
            "the controller closed the connection: wrong secret, or the job is not waiting "
            "for this host"
        ) from None
    proof = welcome.fields.get("proof")
    if not isinstance(proof, str) or not hmac.compare_digest(
        proof, prove(secret, "controller", nonce)
    ):
        raise AuthenticationError("the controller could not prove the job's secret")
    connection.sock.settimeout(None)


def new_secret() -> bytes:
    return secrets.token_hex(SECRET_BYTES).encode()


def read_secret(path: str, create: bool = False) -> bytes:
    """The secret in ``path`` (``-``: standard input); ``create`` makes a new file, mode 0600.

    A file other users can read is refused, as ssh refuses such a key: whoever reads it can join
    the job and run code on every machine.
    """
    if path == "-":
        secret = sys.stdin.readline().strip().encode()
    else:
        file = Path(path).expanduser()
        if create and not file.exists():
            file.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(new_secret() + b"\n")
        try:
            mode = file.stat().st_mode
            secret = file.read_bytes().strip()
        except OSError as error:
            raise ConfigError("secret_file", path, f"a readable file ({error.strerror})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                "secret_file",
                path,
                f"a file only its owner can read (mode is {stat.S_IMODE(mode):04o}; chmod 600 it)",
            )
    if len(secret) < 16:
        raise ConfigError("secret_file", path, "a secret of at least 16 characters")
    return secret

"""Messages between a job's controller and its host agents, and the handshake that admits an agent.

A message is a JSON object (its ``kind`` and fields) and an optional binary payload, framed by two
lengths. Nothing is ever unpickled, and every message is checked against what its sender may send
(:data:`FROM_CONTROLLER`, :data:`FROM_AGENT`): an unknown kind, a missing field or a field of the
wrong type is a :class:`ProtocolError` naming the peer, never a crash further on.

The handshake has one deadline and small frames, so a stranger can hold neither side long nor make
it allocate much. Each side proves the job's secret with an HMAC over its role and both sides'
random nonces (so no proof serves in another handshake or for the other role), the agent first:
the controller answers only an agent that proved the secret, and the agent tells its facts only to
a controller that did. From then on every frame is encrypted and authenticated with
ChaCha20-Poly1305 under keys derived from the secret and both nonces, one per direction, each
frame's sequence number its nonce: someone on the path can neither read a frame (the job's
environment holds credentials) nor forge, replay, reorder or drop one unnoticed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import re
import reprlib
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dtrain.errors import ConfigError, DtrainError
from dtrain.jobs.spec import ChannelSpec
from dtrain.launch.netif import format_endpoint
from dtrain.secretfile import create_secret_file, read_secret_file

PROTOCOL_VERSION = 4
"""3: the start message names a module entry point (-m); rank output carries each line's time
and the progress line being drawn. 4: hosts collect their TensorBoard events and report their
channel copies."""
_HEADER = struct.Struct("!II")  # lengths of the JSON fields and of the payload
_TAG_BYTES = 16
MESSAGE_LIMIT = 64 * 1024 * 1024
"""Largest frame part accepted from an admitted peer."""
HANDSHAKE_LIMIT = 16 * 1024
"""Largest frame part accepted before the peer proved the secret."""
HANDSHAKE_TIMEOUT = 10.0
"""The whole handshake's deadline, however slowly a peer trickles its bytes."""
HEARTBEAT_INTERVAL = 1.0
SILENCE_LIMIT = 15.0
"""A peer unheard of for this long is gone (a dead machine, a cut link); heartbeats go both ways
every second."""
SECRET_BYTES = 32
NONCE_BYTES = 16
SHOWN_LIMIT = 500
"""Characters of a peer's text shown in a log line or a failure reason."""


class ConnectionClosed(Exception):
    """The peer closed the connection, or it broke."""


class ProtocolError(Exception):
    """The peer sent something that is not a message of this protocol."""


class AuthenticationError(DtrainError):
    """The peer could not prove the job's secret."""


def shown(text: object, limit: int = SHOWN_LIMIT) -> str:
    """A peer's text as it may appear in a log line: control characters (newlines, terminal
    escapes) escaped, so it cannot forge lines or colours, and at most ``limit`` characters."""
    text = str(text)
    escaped = "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode()
        for char in text[:limit]
    )
    return escaped + (f"... ({len(text) - limit} more characters)" if len(text) > limit else "")


# --- what each side may send ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """What one field of a message must hold; ``allowed`` says so in errors."""

    allowed: str
    test: Callable[[Any], bool]


def _matches(pattern: str) -> Callable[[Any], bool]:
    compiled = re.compile(pattern)
    return lambda value: isinstance(value, str) and compiled.fullmatch(value) is not None


def _is_text_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(item, str) for item in value.values())


def _is_address(value: Any) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return isinstance(value, str)  # ip_address takes an integer too


_CHANNEL_KEYS = {field.name for field in dataclasses.fields(ChannelSpec)}


def _is_channel(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and {"name", "uri"} <= value.keys() <= _CHANNEL_KEYS
        and all(item is None or isinstance(item, str) for item in value.values())
    )


COUNT = Check("an integer >= 0", lambda value: type(value) is int and value >= 0)
INTEGER = Check("an integer", lambda value: type(value) is int)
NUMBER = Check("a number", lambda value: type(value) in (int, float))
TEXT = Check("a string", lambda value: isinstance(value, str))
FLAG = Check("true or false", lambda value: isinstance(value, bool))
TEXTS = Check(
    "a list of strings",
    lambda value: isinstance(value, list) and all(isinstance(item, str) for item in value),
)
TIMED_TEXTS = Check(
    "a list of [time, string] pairs",
    lambda value: (
        isinstance(value, list)
        and all(
            isinstance(item, list)
            and len(item) == 2
            and type(item[0]) in (int, float)
            and isinstance(item[1], str)
            for item in value
        )
    ),
)
TEXT_OR_NULL = Check("a string or null", lambda value: value is None or isinstance(value, str))
TEXT_MAP = Check("an object of strings", _is_text_map)
NONCE = Check(f"{2 * NONCE_BYTES} hex digits", _matches(f"[0-9a-f]{{{2 * NONCE_BYTES}}}"))
PROOF = Check("64 hex digits", _matches("[0-9a-f]{64}"))
PORT = Check("a port number", lambda value: type(value) is int and 0 < value < 65536)
ADDRESS = Check("a numeric IP address", _is_address)
HOST_NAME = Check(
    "null or a host name (algo-N)", lambda value: value is None or _matches(r"algo-[1-9]\d*")(value)
)
CONFIG_FILES = Check(
    "an object of file names to text",
    lambda value: _is_text_map(value) and all(_matches(r"[\w-][\w.-]*")(name) for name in value),
)
CHANNELS = Check(
    "a list of channels (objects with a name, a uri and other strings)",
    lambda value: isinstance(value, list) and all(_is_channel(item) for item in value),
)
RANK_ENVIRONMENTS = Check(
    "an object of rank numbers to environments",
    lambda value: (
        isinstance(value, dict)
        and all(
            rank.isascii() and rank.isdigit() and _is_text_map(env) for rank, env in value.items()
        )
    ),
)
CODE_STREAM = Check("'code'", lambda value: value == "code")
RESULT_STREAM = Check(
    "'model', 'output' or 'tensorboard'", lambda value: value in ("model", "output", "tensorboard")
)

Fields = Mapping[str, Check]
Protocol = Mapping[str, Fields]
"""What one side may send: each kind of message, and the fields it must hold."""

_ERROR: Fields = {"message": TEXT}
FROM_CONTROLLER: Protocol = {
    "challenge": {"version": INTEGER, "nonce": NONCE},
    "welcome": {"proof": PROOF},
    "error": _ERROR,
    "heartbeat": {},
    "refused": {"reason": TEXT},
    "bye": {},
    "prepare": {
        "root": TEXT,
        "config": CONFIG_FILES,
        "channels": CHANNELS,
        "host_index": COUNT,
        "host_count": COUNT,
        "environment": TEXT_MAP,
        "checkpoint_dir": TEXT,
        "tensorboard_dir": TEXT,
        "progress": FLAG,
        "again": FLAG,
        "job_name": TEXT,
        "key_salt": NONCE,
    },
    "chunk": {"stream": CODE_STREAM},
    "end": {"stream": CODE_STREAM},
    "open_store": {"attempt": COUNT},
    "close_store": {"attempt": COUNT},
    "start": {
        "attempt": COUNT,
        "entry_point": TEXT,
        "module": FLAG,
        "arguments": TEXTS,
        "ranks": RANK_ENVIRONMENTS,
        "defaults": TEXT_MAP,
    },
    "stop": {"attempt": COUNT},
    "send": {"stream": RESULT_STREAM},
}
FROM_AGENT: Protocol = {
    "hello": {"version": INTEGER, "nonce": NONCE, "proof": PROOF},
    "facts": {
        "address": ADDRESS,
        "interface": TEXT,
        "machine": TEXT,
        "hostname": TEXT,
        "cpus": Check("an integer >= 1", lambda value: type(value) is int and value >= 1),
        "gpus": TEXTS,
        "home": TEXT,
        "pid": COUNT,
        "host": HOST_NAME,
    },
    "error": _ERROR,
    "heartbeat": {},
    "copied": {"channel": TEXT, "done": COUNT, "total": COUNT, "final": FLAG},
    "prepared": {},
    "store": {"attempt": COUNT, "port": PORT},
    "output": {"attempt": COUNT, "rank": COUNT, "lines": TIMED_TEXTS, "frame": TEXT_OR_NULL},
    "exited": {
        "attempt": COUNT,
        "rank": COUNT,
        "code": INTEGER,
        "time": NUMBER,
        "tail": TEXT,
        "stopped": FLAG,
    },
    "done": {"attempt": COUNT},
    "leaving": {"reason": TEXT},
    "chunk": {"stream": RESULT_STREAM},
    "end": {"stream": RESULT_STREAM},
}


@dataclasses.dataclass(frozen=True)
class Message:
    kind: str
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    payload: bytes = b""

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


class _Cipher:
    """One direction's frames: the nonce is the frame's number, so a frame replayed, reordered
    or dropped fails to open as a forged one does."""

    def __init__(self, key: bytes) -> None:
        self._aead = ChaCha20Poly1305(key)
        self.sequence = 0

    def seal(self, data: bytes, header: bytes) -> bytes:
        sealed = self._aead.encrypt(self.sequence.to_bytes(12, "big"), data, header)
        self.sequence += 1
        return sealed

    def open(self, sealed: bytes, header: bytes) -> bytes | None:
        try:
            data = self._aead.decrypt(self.sequence.to_bytes(12, "big"), sealed, header)
        except InvalidTag:
            return None
        self.sequence += 1
        return data


class Connection:
    """Whole messages over one socket, checked against ``receives`` (what the peer may send);
    sends from several threads go out one at a time."""

    def __init__(self, sock: socket.socket, receives: Protocol) -> None:
        self.sock = sock
        self.receives = receives
        self._send_lock = threading.Lock()
        self._sealing: _Cipher | None = None
        self._opening: _Cipher | None = None
        self._deadline: float | None = None
        self._timeout = 0.0
        try:
            address = sock.getpeername()
        except OSError:
            address = None
        self.peer = format_endpoint(*address[:2]) if isinstance(address, tuple) else "a local peer"

    def begin_handshake(self, timeout: float) -> None:
        """Every send and receive from now on must end within ``timeout`` seconds in all."""
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout

    def secure(self, sending: bytes, receiving: bytes) -> None:
        """Encrypt and authenticate every frame from now on, each direction under its key."""
        with self._send_lock:
            self._sealing, self._opening = _Cipher(sending), _Cipher(receiving)

    def end_handshake(self) -> None:
        self._deadline = None
        self.sock.settimeout(None)

    def send(self, kind: str, payload: bytes = b"", **fields: Any) -> None:
        body = json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()
        header = _HEADER.pack(len(body), len(payload))
        try:
            with self._send_lock:
                self._arm()
                if self._sealing is None:
                    self.sock.sendall(header + body + payload)
                else:
                    self.sock.sendall(header + self._sealing.seal(body + payload, header))
        except TimeoutError:
            raise self._late() from None
        except OSError as error:
            raise ConnectionClosed(f"send to {self.peer} failed: {error}") from None

    def receive(self, limit: int = MESSAGE_LIMIT) -> Message:
        header = self._read(_HEADER.size)
        body_size, payload_size = _HEADER.unpack(header)
        if body_size > limit or payload_size > limit:
            raise ProtocolError(f"{self.peer} sent a frame over {limit} bytes")
        if self._opening is None:
            frame = self._read(body_size + payload_size)
        else:
            sealed = self._read(body_size + payload_size + _TAG_BYTES)
            opened = self._opening.open(sealed, header)
            if opened is None:
                raise ProtocolError(
                    f"{self.peer} sent a frame that fails authentication (frame "
                    f"{self._opening.sequence}: forged, replayed, reordered or corrupted)"
                )
            frame = opened
        return self._message(frame[:body_size], frame[body_size:])

    def _message(self, body: bytes, payload: bytes) -> Message:
        """The message in ``body``, if it is one the peer may send with the fields it must hold."""
        try:
            fields = json.loads(body, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as error:  # bad UTF-8 and bad JSON are ValueErrors
            raise ProtocolError(
                f"{self.peer} sent a frame that is not JSON: {shown(error)}"
            ) from None
        if not isinstance(fields, dict) or not isinstance(fields.get("kind"), str):
            raise ProtocolError(f"{self.peer} sent a frame without a kind")
        kind = fields.pop("kind")
        expected = self.receives.get(kind)
        if expected is None:
            raise ProtocolError(f"{self.peer} sent a message of unknown kind '{shown(kind, 60)}'")
        for name, check in expected.items():
            if name not in fields or not check.test(fields[name]):
                value = shown(reprlib.repr(fields[name]), 100) if name in fields else "nothing"
                raise ProtocolError(
                    f"{self.peer} sent {kind!r} with {name} = {value}; allowed: {check.allowed}"
                )
        return Message(kind, {name: fields[name] for name in expected}, payload)

    def expect(self, kind: str, limit: int = MESSAGE_LIMIT) -> Message:
        message = self.receive(limit)
        if message.kind == "error":
            raise ProtocolError(f"{self.peer} answered: {shown(message['message'])}")
        if message.kind != kind:
            raise ProtocolError(f"{self.peer} sent {message.kind!r} where {kind!r} was due")
        return message

    def _arm(self) -> None:
        """During the handshake, the socket waits only until its deadline."""
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise self._late()
            self.sock.settimeout(left)

    def _late(self) -> ConnectionClosed:
        if self._deadline is None:
            return ConnectionClosed(f"{self.peer} went silent mid-message")
        return ConnectionClosed(
            f"{self.peer} did not finish the handshake within {self._timeout:g} s"
        )

    def _read(self, size: int) -> bytes:
        buffer = bytearray(size)
        view = memoryview(buffer)
        done = 0
        while done < size:
            self._arm()
            try:
                received = self.sock.recv_into(view[done:], size - done)
            except TimeoutError:
                raise self._late() from None
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


# --- the handshake ----------------------------------------------------------------------------


def prove(secret: bytes, role: str, controller_nonce: str, agent_nonce: str) -> str:
    """The proof that ``role`` holds the secret, in the handshake of these two nonces."""
    text = f"dtrain/{PROTOCOL_VERSION}/{role}/{controller_nonce}/{agent_nonce}"
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def session_keys(secret: bytes, controller_nonce: str, agent_nonce: str) -> tuple[bytes, bytes]:
    """The keys of the frames after the handshake: the controller's, then the agent's."""
    keys = HKDF(
        algorithm=hashes.SHA256(),
        length=64,
        salt=bytes.fromhex(controller_nonce + agent_nonce),
        info=f"dtrain/{PROTOCOL_VERSION}/session keys".encode(),
    ).derive(secret)
    return keys[:32], keys[32:]


def _version_mismatch(theirs: int, who: str) -> AuthenticationError:
    return AuthenticationError(
        f"the {who} speaks protocol {theirs}, this dtrain {PROTOCOL_VERSION}: install the same "
        "dtrain version on every machine"
    )


def admit_agent(
    connection: Connection, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT
) -> Message:
    """Controller side: challenge a new connection; the agent's ``facts`` once both proved the
    secret. A refused agent is told why (its user reads it; the agent cannot trust it)."""
    connection.begin_handshake(timeout)
    nonce = secrets.token_hex(NONCE_BYTES)
    connection.send("challenge", nonce=nonce, version=PROTOCOL_VERSION)
    hello = connection.expect("hello", limit=HANDSHAKE_LIMIT)
    try:
        if hello["version"] != PROTOCOL_VERSION:
            raise _version_mismatch(hello["version"], "agent")
        if not hmac.compare_digest(hello["proof"], prove(secret, "agent", nonce, hello["nonce"])):
            raise AuthenticationError("wrong secret")
    except AuthenticationError as error:
        with contextlib.suppress(ConnectionClosed):
            connection.send("error", message=f"the controller refused this agent: {error}")
        raise
    connection.send("welcome", proof=prove(secret, "controller", nonce, hello["nonce"]))
    to_agent, to_controller = session_keys(secret, nonce, hello["nonce"])
    connection.secure(sending=to_agent, receiving=to_controller)
    facts = connection.expect("facts", limit=HANDSHAKE_LIMIT)
    connection.end_handshake()
    return facts


def join_controller(
    connection: Connection,
    secret: bytes,
    facts: dict[str, Any],
    timeout: float = HANDSHAKE_TIMEOUT,
) -> None:
    """Agent side: prove the secret, check the controller's proof, then tell it ``facts``."""
    connection.begin_handshake(timeout)
    challenge = connection.expect("challenge", limit=HANDSHAKE_LIMIT)
    if challenge["version"] != PROTOCOL_VERSION:
        raise _version_mismatch(challenge["version"], "controller")
    nonce = secrets.token_hex(NONCE_BYTES)
    proof = prove(secret, "agent", challenge["nonce"], nonce)
    connection.send("hello", version=PROTOCOL_VERSION, nonce=nonce, proof=proof)
    welcome = connection.expect("welcome", limit=HANDSHAKE_LIMIT)
    expected = prove(secret, "controller", challenge["nonce"], nonce)
    if not hmac.compare_digest(welcome["proof"], expected):
        raise AuthenticationError(f"{connection.peer} could not prove the job's secret")
    to_agent, to_controller = session_keys(secret, challenge["nonce"], nonce)
    connection.secure(sending=to_controller, receiving=to_agent)
    connection.send("facts", **facts)
    connection.end_handshake()


def new_secret() -> bytes:
    return secrets.token_hex(SECRET_BYTES).encode()


def read_secret(path: str, create: bool = False) -> bytes:
    """The secret in ``path`` (``-``: standard input); ``create`` makes a new file, mode 0600.

    A file is read only if it passes :mod:`dtrain.secretfile`'s checks (as ssh refuses a key
    others can read or replace): whoever reads it can join the job and run code on every
    machine.
    """
    if path == "-":
        secret = sys.stdin.readline().strip().encode()
    else:
        if create:
            create_secret_file(path, new_secret() + b"\n")
        secret = read_secret_file("secret_file", path).strip()
    if len(secret) < 16:
        raise ConfigError("secret_file", path, "a secret of at least 16 characters")
    return secret

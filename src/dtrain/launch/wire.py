"""Messages between a job's controller and its host agents: framed, checked and, once the
handshake (:mod:`handshake`) has keyed them, sealed.

A message is a JSON object (its ``kind`` and fields) and an optional binary payload, framed by two
lengths. Nothing is ever unpickled, and every message is checked against what its sender may send
(:data:`FROM_CONTROLLER`, :data:`FROM_AGENT`): an unknown kind, a missing field or a field of the
wrong type is a :class:`ProtocolError` naming the peer, never a crash further on. After the
handshake every frame is encrypted and authenticated with ChaCha20-Poly1305, one key per
direction, each frame's sequence number its nonce: someone on the path can neither read a frame
(the job's environment holds credentials) nor forge, replay, reorder or drop one unnoticed.

Every send has a deadline: a peer that takes no byte of a frame for :data:`SILENCE_LIMIT` (a
frozen machine keeps its connection at a zero window) fails the send, and a heartbeat never waits
for room or behind another frame (:meth:`Connection.send` with ``wait=False``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import re
import reprlib
import secrets
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from dtrain.errors import ConfigError
from dtrain.jobs.spec import ChannelSpec
from dtrain.launch.netif import format_endpoint
from dtrain.secretfile import create_secret_file, read_secret_file

PROTOCOL_VERSION = 5
"""3: the start message names a module entry point (-m); rank output carries each line's time
and the progress line being drawn. 4: hosts collect their TensorBoard events and report their
channel copies. 5: the agent proves the secret in its first frame, over the time."""
_HEADER = struct.Struct("!II")  # lengths of the JSON fields and of the payload
_ABORT_CHECK_INTERVAL = 1.0  # the longest a waiting send goes without looking for an abort
_TAG_BYTES = 16
MESSAGE_LIMIT = 64 * 1024 * 1024
"""Largest frame part accepted from an admitted peer."""
HANDSHAKE_LIMIT = 16 * 1024
"""Largest frame part accepted before the peer proved the secret."""
HELLO_LIMIT = 1024
"""Largest first frame a connection may send (an agent's hello is about 200 bytes)."""
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


class SendStalled(ConnectionClosed):
    """The peer took no byte of a frame for too long (a frozen machine, a dead link)."""


class ProtocolError(Exception):
    """The peer sent something that is not a message of this protocol."""


def shown(text: object, limit: int | None = SHOWN_LIMIT) -> str:
    """A peer's text as it may appear on a console or in a log line: every character but a tab
    that is not printable (newlines and other line breaks, terminal escapes, direction marks,
    lone surrogates) escaped, so it can neither forge lines nor move the cursor, and at most
    ``limit`` characters (None: all, for a rank's output)."""
    text = str(text)
    cut = text if limit is None else text[:limit]
    escaped = "".join(
        char if char.isprintable() or char == "\t" else _escaped(char) for char in cut
    )
    if limit is not None and len(text) > limit:
        escaped += f"... ({len(text) - limit} more characters)"
    return escaped


def _escaped(char: str) -> str:
    """``\\n``, ``\\x1b``, ``\\u202e``: as Python writes the character in a string literal."""
    return char.encode("unicode_escape", errors="backslashreplace").decode("ascii")


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
    "challenge": {"version": INTEGER, "nonce": NONCE},  # on accepting, before the hello is read
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
    "hello": {"version": INTEGER, "time": COUNT, "nonce": NONCE, "proof": PROOF},
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
    sends from several threads go out one at a time, each within a deadline."""

    def __init__(self, sock: socket.socket, receives: Protocol) -> None:
        self.sock = sock
        self.receives = receives
        self.stall_limit: float | None = SILENCE_LIMIT
        """Seconds a send may wait for the peer to take another byte; None: as long as it
        takes, until :meth:`abort` (whoever watches the peer's heartbeats ends it)."""
        self._send_lock = threading.Lock()
        self._sealing: _Cipher | None = None
        self._opening: _Cipher | None = None
        self._deadline: float | None = None
        self._timeout = 0.0
        self._aborted: str | None = None
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

    def send(self, kind: str, payload: bytes = b"", wait: bool = True, **fields: Any) -> bool:
        """Send one message; whether it went.

        A send waits for the peer to take each byte at most :attr:`stall_limit` seconds (during
        the handshake: until its deadline), then fails, and the connection with it: a frame cut
        short cannot be resumed. ``wait=False`` (heartbeats) sends nothing, and returns False,
        while another frame is going out or the socket has no room: it never waits on the peer.
        """
        body = json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()
        header = _HEADER.pack(len(body), len(payload))
        if not self._send_lock.acquire(blocking=wait):
            return False
        try:
            if not wait and not self._writable(0):
                return False
            if self._sealing is None:
                frame = header + body + payload
            else:
                frame = header + self._sealing.seal(body + payload, header)
            self._send_all(memoryview(frame))
        except ConnectionClosed as error:
            self.abort(str(error))  # the peer would read the rest of the cut frame as a new one
            raise
        finally:
            self._send_lock.release()
        return True

    def _send_all(self, frame: memoryview) -> None:
        """Every byte of ``frame``, without blocking the socket (another thread reads it)."""
        last_progress = time.monotonic()
        while frame:
            self._check_aborted()
            try:
                sent = self.sock.send(frame, socket.MSG_DONTWAIT)
            except (BlockingIOError, TimeoutError):
                sent = 0
            except OSError as error:
                self._check_aborted()
                raise ConnectionClosed(f"send to {self.peer} failed: {error}") from None
            now = time.monotonic()
            if sent:
                frame, last_progress = frame[sent:], now
                continue
            if self._deadline is not None:
                left = self._deadline - now
                if left <= 0:
                    raise self._late()
            elif self.stall_limit is None:
                left = _ABORT_CHECK_INTERVAL
            else:
                left = last_progress + self.stall_limit - now
                if left <= 0:
                    raise SendStalled(f"{self.peer} took no data for {self.stall_limit:g} s")
            self._writable(min(left, _ABORT_CHECK_INTERVAL))

    def _writable(self, timeout: float) -> bool:
        """Whether the socket has room (or has failed: the send says how) within ``timeout``."""
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        return bool(poller.poll(max(timeout, 0) * 1000))

    def abort(self, reason: str) -> None:
        """End the connection for ``reason``: every send or receive under way or to come fails
        with it at once (a thread blocked on a frozen peer wakes). The first reason stays."""
        if self._aborted is None:
            self._aborted = reason
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _check_aborted(self) -> None:
        if self._aborted is not None:
            raise ConnectionClosed(self._aborted)

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
        return checked_message(frame[:body_size], frame[body_size:], self.receives, self.peer)

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
                self._check_aborted()
                raise ConnectionClosed(f"receive from {self.peer} failed: {error}") from None
            if received == 0:
                self._check_aborted()
                raise ConnectionClosed(f"{self.peer} closed the connection")
            done += received
        return bytes(buffer)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def checked_message(body: bytes, payload: bytes, receives: Protocol, peer: str) -> Message:
    """The message in ``body``, if it is one of ``receives`` with the fields it must hold;
    a :class:`ProtocolError` naming ``peer`` otherwise."""
    try:
        fields = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:  # bad UTF-8 and bad JSON are ValueErrors
        raise ProtocolError(f"{peer} sent a frame that is not JSON: {shown(error)}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("kind"), str):
        raise ProtocolError(f"{peer} sent a frame without a kind")
    kind = fields.pop("kind")
    expected = receives.get(kind)
    if expected is None:
        raise ProtocolError(f"{peer} sent a message of unknown kind '{shown(kind, 60)}'")
    for name, check in expected.items():
        if name not in fields or not check.test(fields[name]):
            value = shown(reprlib.repr(fields[name]), 100) if name in fields else "nothing"
            raise ProtocolError(
                f"{peer} sent {kind!r} with {name} = {value}; allowed: {check.allowed}"
            )
    return Message(kind, {name: fields[name] for name in expected}, payload)


def first_frame(buffer: bytes, peer: str) -> tuple[Message | None, int]:
    """The hello at the start of what a new connection sent, or None and how many more bytes it
    takes; a frame over :data:`HELLO_LIMIT` or anything but a hello is a :class:`ProtocolError`
    before more is read."""
    if len(buffer) < _HEADER.size:
        return None, _HEADER.size - len(buffer)
    body_size, payload_size = _HEADER.unpack_from(buffer)
    if body_size > HELLO_LIMIT or payload_size:
        raise ProtocolError(f"{peer} sent a first frame over {HELLO_LIMIT} bytes")
    missing = _HEADER.size + body_size - len(buffer)
    if missing > 0:
        return None, missing
    message = checked_message(buffer[_HEADER.size :], b"", FROM_AGENT, peer)
    if message.kind != "hello":
        raise ProtocolError(f"{peer} sent {message.kind!r} where 'hello' was due")
    return message, 0


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

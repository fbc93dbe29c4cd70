"""The controller's door: every new connection until its first frame proved the job's secret.

An agent sends its hello, which proves the secret (:func:`~dtrain.launch.handshake.prove_hello`),
at once on connecting, so one thread reads the first frames of every new connection without
blocking on any, and a connection costs the controller a descriptor and a few hundred bytes until
then, no thread. Whatever is not a fresh hello that proves the secret is dropped as soon as it is
seen; a connection that sent nothing within :data:`~dtrain.launch.handshake.HELLO_TIMEOUT` is
dropped; at most :data:`MAX_PENDING` connections wait at once, :data:`PER_SOURCE` of them from one
address, and a new one pushes out the oldest (of its address first). So strangers that connect
again as soon as they are dropped hold nothing for long, and an agent, whose hello is usually
there when its connection is accepted, gets in however many they are. A connection whose hello
passed goes to ``admit`` (off this thread) to finish the handshake.
"""

from __future__ import annotations

import contextlib
import dataclasses
import selectors
import socket
import threading
import time
from collections.abc import Callable

from dtrain.launch.handshake import (
    HELLO_TIMEOUT,
    AuthenticationError,
    HelloCheck,
    refuse,
    send_challenge,
)
from dtrain.launch.wire import (
    FROM_AGENT,
    Connection,
    ConnectionClosed,
    Message,
    ProtocolError,
    first_frame,
    shown,
)

MAX_PENDING = 64
"""Connections awaiting their first frame at once; one more pushes out the oldest."""
PER_SOURCE = 16
"""Of them, from one address; one more from there pushes out that address's oldest."""
ACCEPT_RETRY_DELAY = 0.1
"""The pause after a failed accept (out of descriptors, say), so the port is never given up."""


@dataclasses.dataclass(eq=False)
class _Pending:
    connection: Connection
    source: str
    nonce: str
    deadline: float
    buffer: bytearray = dataclasses.field(default_factory=bytearray)


class Door:
    """Reads first frames on ``listener`` while ``accepting`` is set (others are closed at once) and
    hands each connection whose hello passed ``check`` to ``admit(connection, hello, nonce)``;
    ``notice`` hears every connection dropped and why."""

    def __init__(
        self,
        listener: socket.socket,
        check: HelloCheck,
        admit: Callable[[Connection, Message, str], None],
        notice: Callable[[str], None],
        accepting: threading.Event,
        hello_timeout: float = HELLO_TIMEOUT,
        max_pending: int = MAX_PENDING,
        per_source: int = PER_SOURCE,
    ) -> None:
        self.listener = listener
        self.check = check
        self.admit = admit
        self.notice = notice
        self.accepting = accepting
        self.hello_timeout = hello_timeout
        self.max_pending = max_pending
        self.per_source = per_source
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._closed = threading.Event()
        self._selector = selectors.DefaultSelector()
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="controller-door", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop reading and shut the listener (its owner closes it); drop every connection still
        waiting."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the thread
        self._thread.join()

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                ready = self._selector.select(timeout=self.hello_timeout / 2)
                accepting = False
                for key, _ in ready:  # frames first: an agent's is never pushed out by newcomers
                    if key.fileobj is self.listener:
                        accepting = True
                    elif key.fileobj in self._pending:
                        self._read(self._pending[key.fileobj])
                if accepting and not self._closed.is_set():
                    self._accept()
                self._expire()
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending, None)
            self._selector.close()

    def _accept(self) -> None:
        for _ in range(self.max_pending):
            try:
                sock, peer = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as error:
                if self._closed.is_set():
                    return
                self.notice(f"cannot accept a connection ({error}); trying again")
                self._closed.wait(ACCEPT_RETRY_DELAY)
                return
            if not self.accepting.is_set():
                sock.close()  # an agent retries until the job awaits hosts again
                continue
            self._take(sock, peer)

    def _take(self, sock: socket.socket, peer: tuple[str, ...]) -> None:
        sock.setblocking(True)  # for the handshake's threads: the door's own calls never wait
        connection = Connection(sock, FROM_AGENT)
        try:
            nonce = send_challenge(connection)
        except ConnectionClosed as error:
            self.notice(f"refused a connection from {connection.peer}: {error}")
            connection.close()
            return
        pending = _Pending(connection, peer[0], nonce, time.monotonic() + self.hello_timeout)
        self._make_room(pending.source)
        self._pending[sock] = pending
        self._selector.register(sock, selectors.EVENT_READ)
        self._read(pending)  # an agent's hello is usually there already

    def _make_room(self, source: str) -> None:
        """Push out the oldest connection of ``source`` if it has its share, else the oldest."""
        same = [pending for pending in self._pending.values() if pending.source == source]
        if len(same) >= self.per_source:
            self._drop(same[0], f"{self.per_source} connections from {source} await a first frame")
        elif len(self._pending) >= self.max_pending:
            oldest = next(iter(self._pending.values()))
            self._drop(oldest, f"{self.max_pending} connections await a first frame")

    def _read(self, pending: _Pending) -> None:
        try:
            self._read_hello(pending)
        except Exception as error:  # whatever a stranger sent ends its connection, nothing else
            self._drop(pending, f"{type(error).__name__}: {error}")

    def _read_hello(self, pending: _Pending) -> None:
        connection = pending.connection
        try:
            while True:
                hello, missing = first_frame(bytes(pending.buffer), connection.peer)
                if hello is not None:
                    break
                try:
                    data = connection.sock.recv(missing, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return  # the rest later
                except OSError as error:
                    raise ConnectionClosed(f"receive failed: {error}") from None
                if not data:
                    raise ConnectionClosed("it closed the connection before its hello")
                pending.buffer += data
            self.check(hello)
        except AuthenticationError as error:
            refuse(connection, error)
            self._drop(pending, str(error))
            return
        except (ProtocolError, ConnectionClosed) as error:
            self._drop(pending, str(error))
            return
        self._forget(pending)
        self.admit(connection, hello, pending.nonce)

    def _expire(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            self._drop(pending, f"sent no hello within {self.hello_timeout:g} s")

    def _forget(self, pending: _Pending) -> None:
        sock = pending.connection.sock
        del self._pending[sock]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)

    def _drop(self, pending: _Pending, why: str | None) -> None:
        if pending.connection.sock not in self._pending:
            return  # dropped already
        self._forget(pending)
        pending.connection.close()
        if why is not None:
            self.notice(f"refused a connection from {pending.connection.peer}: {shown(why)}")

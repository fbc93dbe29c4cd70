"""The controller's connections to the job's agents, and one queue of what they report.

One thread accepts connections and admits only agents that prove the job's secret (a refused one
is logged, a few a minute at most), only while the job awaits hosts, at most
:data:`MAX_HANDSHAKES` at once, each within one deadline: a flood of connections, a slow one or
garbage costs a bounded number of threads and descriptors and never stops the job. One thread per
agent reads its messages, passing rank output straight on (so a rank's last lines always precede
its exit), feeding requested tar streams, and queueing everything else; a report must name an
attempt and a rank the host runs. One thread sends heartbeats and declares an agent unheard of
for too long lost, even in the middle of a transfer. Whoever consumes the queue
(:mod:`controller`) sees a host that went silent, closed its connection or broke the protocol as
:class:`Lost`, once, in whatever phase that happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from dtrain.launch.netif import format_endpoint
from dtrain.launch.outcome import Failure
from dtrain.launch.transfer import ChunkReader
from dtrain.launch.wire import (
    FROM_AGENT,
    HANDSHAKE_TIMEOUT,
    HEARTBEAT_INTERVAL,
    SILENCE_LIMIT,
    AuthenticationError,
    Connection,
    ConnectionClosed,
    Message,
    ProtocolError,
    admit_agent,
    shown,
)

MAX_HANDSHAKES = 32
"""Connections in their handshake at once; one more is closed at once (an agent retries)."""
ACCEPT_RETRY_DELAY = 0.1
"""The pause after a failed accept (out of descriptors, say), so the port is never given up."""
NOTICES_PER_MINUTE = 20
"""Refused connections said a minute; more are counted, so a flood cannot flood the log."""


@dataclasses.dataclass(eq=False)
class Link:
    """One admitted agent."""

    connection: Connection
    facts: dict[str, Any]
    name: str | None = None
    last_heard: float = dataclasses.field(default_factory=time.monotonic)
    streams: dict[str, ChunkReader] = dataclasses.field(default_factory=dict)
    ranks: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    """The ranks this host was started with, by attempt: what its reports may name."""
    gone: bool = False
    silent: bool = False

    @property
    def address(self) -> str:
        return str(self.facts["address"])


@dataclasses.dataclass(frozen=True)
class Joined:
    link: Link


@dataclasses.dataclass(frozen=True)
class Received:
    link: Link
    message: Message


@dataclasses.dataclass(frozen=True)
class Lost:
    link: Link
    reason: str
    time: float


Event = Joined | Received | Lost


class _Notices:
    """Says at most ``limit`` lines a minute; how many it held back goes with the next one."""

    def __init__(self, say: Callable[[str], None], limit: int) -> None:
        self.say = say
        self.limit = limit
        self._lock = threading.Lock()
        self._minute = time.monotonic()
        self._said = 0
        self._held = 0

    def __call__(self, line: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._minute >= 60:
                self._minute, self._said = now, 0
            if self._said >= self.limit:
                self._held += 1
                return
            self._said += 1
            if self._held:
                line += f" ({self._held} more unsaid before this)"
                self._held = 0
        self.say(line)


class Links:
    """The agents admitted on ``listener``; ``on_output(host, attempt, rank, lines, frame)``
    (``[time, line]`` pairs and the rank's progress line being drawn)."""

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        on_output: Callable[[str, int, int, list[list[Any]], str | None], None],
        say: Callable[[str], None],
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_handshakes: int = MAX_HANDSHAKES,
    ) -> None:
        self.listener = listener
        self.secret = secret
        self.on_output = on_output
        self.say = say
        self.handshake_timeout = handshake_timeout
        self.events: queue.Queue[Event] = queue.Queue()
        self.by_name: dict[str, Link] = {}
        """Agents that hold a host name (see :meth:`controller.Controller.gather`)."""
        self.awaiting = threading.Event()
        """Set while the job awaits hosts: only then are connections admitted."""
        self.awaiting.set()
        self._max_handshakes = max_handshakes
        self._handshakes = threading.BoundedSemaphore(max_handshakes)
        self._notice = _Notices(say, NOTICES_PER_MINUTE)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="controller-accept", daemon=True).start()
        threading.Thread(target=self._beat, name="controller-heartbeat", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self.listener.accept()
            except OSError as error:
                if self._closed.is_set():
                    return
                self._notice(f"cannot accept a connection ({error}); trying again")
                self._closed.wait(ACCEPT_RETRY_DELAY)
                continue
            if not self.awaiting.is_set():
                sock.close()  # an agent retries until the job awaits hosts again
                continue
            if not self._handshakes.acquire(blocking=False):
                sock.close()
                self._notice(
                    f"closed a connection from {format_endpoint(*peer[:2])}: "
                    f"{self._max_handshakes} handshakes are under way already"
                )
                continue
            try:
                threading.Thread(
                    target=self._admit, args=(sock, peer), name="controller-admit", daemon=True
                ).start()
            except RuntimeError as error:  # no thread to be had
                self._handshakes.release()
                sock.close()
                self._notice(f"cannot admit a connection ({error})")

    def _admit(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        connection = Connection(sock, FROM_AGENT)
        try:
            facts = admit_agent(connection, self.secret, self.handshake_timeout)
        except Exception as error:  # whatever a stranger sent ends its connection, nothing else
            known = (AuthenticationError, ProtocolError, ConnectionClosed, OSError)
            why = str(error) if isinstance(error, known) else f"{type(error).__name__}: {error}"
            self._notice(f"refused a connection from {format_endpoint(*peer[:2])}: {shown(why)}")
            connection.close()
            return
        finally:
            self._handshakes.release()
        link = Link(connection, facts.fields)
        self.events.put(Joined(link))
        self._read(link)

    def _read(self, link: Link) -> None:
        try:
            while True:
                message = link.connection.receive()
                link.last_heard = time.monotonic()
                if message.kind == "heartbeat":
                    continue
                if message.kind in ("output", "exited", "done"):
                    self._check_report(link, message)
                if message.kind == "output":
                    assert link.name is not None  # only named hosts are started
                    self.on_output(
                        link.name,
                        message["attempt"],
                        message["rank"],
                        message["lines"],
                        message["frame"],
                    )
                elif message.kind in ("chunk", "end"):
                    stream = link.streams.get(message["stream"])
                    if stream is None:
                        raise ProtocolError(f"sent {message['stream']!r}, which nobody asked for")
                    stream.feed(message.payload if message.kind == "chunk" else b"")
                else:
                    self.events.put(Received(link, message))
        except Exception as error:  # whatever ends the reader loses the host
            for stream in link.streams.values():
                stream.fail(ConnectionClosed(str(error)))
            if isinstance(error, ConnectionClosed):
                reason = "its agent's connection closed (agent killed, or its machine went down)"
            elif isinstance(error, ProtocolError):
                reason = f"its agent broke the protocol: {error}"
            else:
                reason = (
                    f"its messages could not be handled: {type(error).__name__}: {shown(error)}"
                )
            self.events.put(Lost(link, reason, time.time()))

    @staticmethod
    def _check_report(link: Link, message: Message) -> None:
        """A report names an attempt this host was started for, and a rank it runs there."""
        attempt, rank = message["attempt"], message.fields.get("rank")
        ranks = link.ranks.get(attempt)
        if ranks is None or (rank is not None and rank not in ranks):
            what = f"rank {rank} of attempt {attempt}" if rank is not None else f"attempt {attempt}"
            raise ProtocolError(f"sent {message.kind!r} for {what}, which this host does not run")

    def _beat(self) -> None:
        """Heartbeats out; a host unheard of for too long is lost, even mid-transfer."""
        while not self._closed.wait(HEARTBEAT_INTERVAL):
            now = time.monotonic()
            for link in list(self.by_name.values()):
                if link.gone or link.silent:
                    continue
                if now - link.last_heard > SILENCE_LIMIT:
                    link.silent = True
                    why = (
                        f"no heartbeat for {SILENCE_LIMIT:g} s (its machine or the network is down)"
                    )
                    for stream in list(link.streams.values()):
                        stream.fail(ConnectionClosed(why))
                    self.events.put(Lost(link, why, time.time()))
                    continue
                with contextlib.suppress(ConnectionClosed):
                    link.connection.send("heartbeat")

    def next(self, timeout: float) -> Event | None:
        """The next report, or None after ``timeout``; each lost host comes out once."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, Lost) and event.link.gone:
            return None  # already reported, by whichever sign came first
        return event

    @staticmethod
    def mark_lost(event: Lost) -> Failure:
        """Close a lost host's connection; the failure that names it."""
        event.link.gone = True
        event.link.connection.close()
        name = event.link.name or "?"
        how = f"({event.link.address}) was lost: {event.reason}"
        return Failure(name, None, event.time, how, lost=True)

    def close(self) -> None:
        """Dismiss every agent (each ends its ranks and exits) and stop listening."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self.listener.close()
        for link in self.by_name.values():
            if not link.gone:
                with contextlib.suppress(ConnectionClosed):
                    link.connection.send("bye")
            link.connection.close()

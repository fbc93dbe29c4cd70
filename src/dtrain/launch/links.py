"""The controller's connections to the job's agents, and one queue of what they report.

One thread accepts connections and admits only agents that prove the job's secret (a refused one
is logged); one thread per agent reads its messages, passing rank output straight on (so a rank's
last lines always precede its exit), feeding requested tar streams, and queueing everything else;
one thread sends heartbeats and declares an agent unheard of for too long lost, even in the
middle of a transfer. Whoever consumes the queue (:mod:`controller`) sees a host that went silent
or closed its connection as :class:`Lost`, once, in whatever phase that happens.
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

from dtrain.launch.outcome import Failure
from dtrain.launch.transfer import ChunkReader
from dtrain.launch.wire import (
    HEARTBEAT_INTERVAL,
    SILENCE_LIMIT,
    AuthenticationError,
    Connection,
    ConnectionClosed,
    Message,
    ProtocolError,
    admit_agent,
)


@dataclasses.dataclass(eq=False)
class Link:
    """One admitted agent."""

    connection: Connection
    hello: dict[str, Any]
    name: str | None = None
    last_heard: float = dataclasses.field(default_factory=time.monotonic)
    streams: dict[str, ChunkReader] = dataclasses.field(default_factory=dict)
    gone: bool = False
    silent: bool = False

    @property
    def address(self) -> str:
        return str(self.hello["address"])


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


class Links:
    """The agents admitted on ``listener``; ``on_output(host, attempt, rank, lines)``."""

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        on_output: Callable[[str, int, int, list[str]], None],
        say: Callable[[str], None],
    ) -> None:
        self.listener = listener
        self.secret = secret
        self.on_output = on_output
        self.say = say
        self.events: queue.Queue[Event] = queue.Queue()
        self.by_name: dict[str, Link] = {}
        """Agents that hold a host name (see :meth:`controller.Controller.gather`)."""
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="controller-accept", daemon=True).start()
        threading.Thread(target=self._beat, name="controller-heartbeat", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._admit, args=(sock, peer), name="controller-admit", daemon=True
            ).start()

    def _admit(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        connection = Connection(sock)
        try:
            hello = admit_agent(connection, self.secret)
        except (AuthenticationError, ProtocolError, ConnectionClosed, OSError) as error:
            self.say(f"refused a connection from {peer[0]}:{peer[1]}: {error}")
            connection.close()
            return
        link = Link(connection, hello.fields)
        self.events.put(Joined(link))
        self._read(link)

    def _read(self, link: Link) -> None:
        try:
            while True:
                message = link.connection.receive()
                link.last_heard = time.monotonic()
                if message.kind == "heartbeat":
                    continue
                if message.kind == "output":
                    assert link.name is not None
                    self.on_output(link.name, message["attempt"], message["rank"], message["lines"])
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
                reason = f"its messages could not be handled: {type(error).__name__}: {error}"
            self.events.put(Lost(link, reason, time.time()))

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
        self.listener.close()
        for link in self.by_name.values():
            if not link.gone:
                with contextlib.suppress(ConnectionClosed):
                    link.connection.send("bye")
            link.connection.close()

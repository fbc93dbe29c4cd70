"""The controller's connections to the job's agents, and one queue of what they report.

The door (:mod:`door`) reads every new connection's first frame, only while the job awaits hosts;
an agent whose hello proved the secret finishes its handshake on a thread of its own, at most
:data:`MAX_HANDSHAKES` at once, within one deadline, and refused connections are logged, a few a
minute at most: strangers, however many and however fast they come back, cost a bounded number of
descriptors and never keep an agent out or stop the job. One thread per agent reads its messages,
passing rank output straight on, escaped (so a rank's last lines always precede its exit), feeding
requested tar streams (:class:`~dtrain.launch.transfer.Streams`), and queueing everything else; a
report must name an attempt and a rank the host runs. One thread sends heartbeats, never waiting
on any host (a heartbeat that cannot go at once is skipped: the frame under way shows the agent
that the controller lives), and declares an agent unheard of for too long lost, ending its
connection, so a phase sending it something (the job's code) stops waiting at once. Whoever
consumes the queue (:mod:`controller`) sees a host that went silent, closed its connection or
broke the protocol as :class:`Lost`, once, in whatever phase that happens.
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

from dtrain.launch.door import Door
from dtrain.launch.handshake import HANDSHAKE_TIMEOUT, HELLO_TIMEOUT, HelloCheck, welcome_agent
from dtrain.launch.outcome import Failure
from dtrain.launch.transfer import Streams
from dtrain.launch.wire import (
    HEARTBEAT_INTERVAL,
    SILENCE_LIMIT,
    Connection,
    ConnectionClosed,
    Message,
    ProtocolError,
    SendStalled,
    shown,
)

MAX_HANDSHAKES = 32
"""Agents whose hello passed finishing their handshake at once; one more is closed (it retries)."""
NOTICES_PER_MINUTE = 20
"""Refused connections said a minute; more are counted, so a flood cannot flood the log."""
BYE_LIMIT = 1.0
"""Seconds an agent has to take its dismissal before its connection is closed without one."""
CLOSED_REASON = "its agent's connection closed (agent killed, or its machine went down)"


def silent_reason() -> str:
    return f"no heartbeat for {SILENCE_LIMIT:g} s (its machine or the network is down)"


def lost_reason(link: Link, error: Exception) -> str:
    """Why ``link``'s host, whose connection failed with ``error``, is lost."""
    if link.silent:  # the heartbeat thread ended the connection: that is why it failed
        return silent_reason()
    if isinstance(error, SendStalled):
        return f"it took no data for {SILENCE_LIMIT:g} s (its machine or the network is down)"
    if isinstance(error, ConnectionClosed):
        return CLOSED_REASON
    if isinstance(error, ProtocolError):
        return f"its agent broke the protocol: {error}"
    return f"its messages could not be handled: {type(error).__name__}: {shown(error)}"


@dataclasses.dataclass(eq=False)
class Link:
    """One admitted agent."""

    connection: Connection
    facts: dict[str, Any]
    name: str | None = None
    last_heard: float = dataclasses.field(default_factory=time.monotonic)
    streams: Streams = dataclasses.field(default_factory=Streams)
    ranks: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    """The ranks this host was started with, by attempt: what its reports may name."""
    feeding: bool = False
    """Its reader waits for room to hand on a chunk: the consumer is slow, not the host."""
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
        hello_timeout: float = HELLO_TIMEOUT,
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
        self._door = Door(
            listener, HelloCheck(secret), self._admit, self._notice, self.awaiting, hello_timeout
        )
        threading.Thread(target=self._beat, name="controller-heartbeat", daemon=True).start()

    def _admit(self, connection: Connection, hello: Message, nonce: str) -> None:
        """Finish the handshake of an agent whose hello passed, off the door's thread."""
        if not self._handshakes.acquire(blocking=False):
            connection.close()
            self._notice(
                f"closed a connection from {connection.peer}: "
                f"{self._max_handshakes} handshakes are under way already"
            )
            return
        try:
            threading.Thread(
                target=self._welcome,
                args=(connection, hello, nonce),
                name="controller-admit",
                daemon=True,
            ).start()
        except RuntimeError as error:  # no thread to be had
            self._handshakes.release()
            connection.close()
            self._notice(f"cannot admit a connection ({error})")

    def _welcome(self, connection: Connection, hello: Message, nonce: str) -> None:
        try:
            facts = welcome_agent(connection, self.secret, hello, nonce, self.handshake_timeout)
        except Exception as error:  # whatever the peer sent ends its connection, nothing else
            known = (ProtocolError, ConnectionClosed, OSError)
            why = str(error) if isinstance(error, known) else f"{type(error).__name__}: {error}"
            self._notice(f"refused a connection from {connection.peer}: {shown(why)}")
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
                    frame = message["frame"]
                    self.on_output(  # escaped: a line holds no line break, no terminal escape
                        link.name,
                        message["attempt"],
                        message["rank"],
                        [[when, shown(line, None)] for when, line in message["lines"]],
                        None if frame is None else shown(frame, None),
                    )
                elif message.kind in ("chunk", "end"):
                    link.feeding = True
                    try:
                        chunk = message.payload if message.kind == "chunk" else b""
                        link.streams.route(message["stream"], chunk)
                    finally:
                        link.feeding = False
                        link.last_heard = time.monotonic()
                else:
                    self.events.put(Received(link, message))
        except Exception as error:  # whatever ends the reader loses the host
            reason = lost_reason(link, error)
            link.streams.fail(ConnectionClosed(reason))
            if not link.silent:  # else the heartbeat thread said so already
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
        """Heartbeats out, never waiting on a host; a host unheard of for too long is lost, even
        mid-transfer, and its connection ended, so whatever waits on it wakes."""
        while not self._closed.wait(HEARTBEAT_INTERVAL):
            now = time.monotonic()
            for link in list(self.by_name.values()):
                if link.gone or link.silent:
                    continue
                if not link.feeding and now - link.last_heard > SILENCE_LIMIT:
                    link.silent = True
                    why = silent_reason()
                    link.streams.fail(ConnectionClosed(why))
                    self.events.put(Lost(link, why, time.time()))
                    link.connection.abort(why)
                    continue
                with contextlib.suppress(ConnectionClosed):
                    link.connection.send("heartbeat", wait=False)

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
        self._door.close()
        self.listener.close()
        for link in self.by_name.values():
            if not link.gone:
                link.connection.stall_limit = BYE_LIMIT  # a frozen host gets no bye, but a close
                with contextlib.suppress(ConnectionClosed):
                    link.connection.send("bye")
            link.connection.close()

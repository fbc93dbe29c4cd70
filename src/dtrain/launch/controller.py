"""The controller's side of the hosts: admit their agents, give them orders, hear their reports.

One thread accepts connections and admits only agents that prove the job's secret (a refused one
is logged); one thread per agent reads its messages, writing rank output straight through (so a
rank's last lines always precede its exit) and queueing everything else; one thread sends
heartbeats. The job's phases (:mod:`job`) run on the caller's thread and consume the queue, where
a host that went silent, closed its connection or was reported dead by its cluster engine shows up
as lost, in whatever phase that happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dtrain.errors import DtrainError
from dtrain.launch.clusters.base import Cluster
from dtrain.launch.env import Host, LaunchPlan
from dtrain.launch.outcome import Attempt, Failure, Outcome, rank_failure
from dtrain.launch.transfer import ChunkReader, repack
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

STOP_CONFIRM_LIMIT = 15.0
"""How long stopped hosts have to confirm that all their ranks ended before they count as lost."""
WAITING_NOTICE_INTERVAL = 15.0


class JobStopped(DtrainError):
    """A stop request (Ctrl-C, ``dtrain stop``, ``--max-run``) came before training."""

    def __init__(self, secondary_status: str, message: str) -> None:
        self.secondary_status = secondary_status
        super().__init__(message)


@dataclasses.dataclass(eq=False)
class _Link:
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
class _Joined:
    link: _Link


@dataclasses.dataclass(frozen=True)
class _Received:
    link: _Link
    message: Message


@dataclasses.dataclass(frozen=True)
class _Lost:
    link: _Link
    reason: str
    time: float


_Event = _Joined | _Received | _Lost


class Controller:
    """Listens on ``listener`` for the job's agents; ``on_output(host, attempt, rank, lines)``."""

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        cluster: Cluster,
        on_output: Callable[[str, int, int, list[str]], None],
        say: Callable[[str], None],
        should_stop: Callable[[], tuple[str, str] | None],
    ) -> None:
        self.listener = listener
        self.secret = secret
        self.cluster = cluster
        self.on_output = on_output
        self.say = say
        self.should_stop = should_stop
        self.events: queue.Queue[_Event] = queue.Queue()
        self.links: dict[str, _Link] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="controller-accept", daemon=True).start()
        threading.Thread(target=self._beat, name="controller-heartbeat", daemon=True).start()

    # --- threads -----------------------------------------------------------------------------

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
        link = _Link(connection, hello.fields)
        self.events.put(_Joined(link))
        self._read(link)

    def _read(self, link: _Link) -> None:
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
                    self.events.put(_Received(link, message))
        except Exception as error:  # whatever ends the reader loses the host
            for stream in link.streams.values():
                stream.fail(ConnectionClosed(str(error)))
            if isinstance(error, ConnectionClosed):
                reason = "its agent's connection closed (agent killed, or its machine went down)"
            elif isinstance(error, ProtocolError):
                reason = f"its agent broke the protocol: {error}"
            else:
                reason = f"its messages could not be handled: {type(error).__name__}: {error}"
            self.events.put(_Lost(link, reason, time.time()))

    def _beat(self) -> None:
        """Heartbeats out; a host unheard of for too long is lost, even mid-transfer."""
        while not self._closed.wait(HEARTBEAT_INTERVAL):
            now = time.monotonic()
            for link in list(self.links.values()):
                if link.gone or link.silent:
                    continue
                if now - link.last_heard > SILENCE_LIMIT:
                    link.silent = True
                    why = (
                        f"no heartbeat for {SILENCE_LIMIT:g} s (its machine or the network is down)"
                    )
                    for stream in list(link.streams.values()):
                        stream.fail(ConnectionClosed(why))
                    self.events.put(_Lost(link, why, time.time()))
                    continue
                with contextlib.suppress(ConnectionClosed):
                    link.connection.send("heartbeat")

    # --- events ------------------------------------------------------------------------------

    def _next(self, timeout: float = 0.1) -> _Event | None:
        """The next report; hosts the cluster engine saw end come out as lost."""
        for host, reason in self.cluster.lost():
            link = self.links.get(host)
            if link is not None and not link.gone:
                return _Lost(link, reason, time.time())
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, _Lost) and event.link.gone:
            return None  # already reported, by whichever sign came first
        return event

    def _mark_lost(self, event: _Lost) -> Failure:
        event.link.gone = True
        event.link.connection.close()
        name = event.link.name or "?"
        how = f"({event.link.address}) was lost: {event.reason}"
        return Failure(name, None, event.time, how, lost=True)

    def _check_stop(self) -> None:
        stop = self.should_stop()
        if stop is not None:
            raise JobStopped(*stop)

    # --- phases ------------------------------------------------------------------------------

    def gather(self, names: Sequence[str], timeout: float) -> list[Host]:
        """Wait until an agent holds each of ``names``; an agent may ask for its name.

        Hosts that hold their name already keep it: after :meth:`forget`, only the forgotten
        ones are waited for.
        """
        deadline = time.monotonic() + timeout
        notice = time.monotonic() + WAITING_NOTICE_INTERVAL
        while missing := [name for name in names if name not in self.links]:
            self._check_stop()
            now = time.monotonic()
            if now > deadline:
                raise DtrainError(f"host(s) {', '.join(missing)} did not join within {timeout:g} s")
            if now > notice:
                self.say(
                    f"waiting for {', '.join(missing)} ({len(self.links)} of {len(names)} joined)"
                )
                notice = now + WAITING_NOTICE_INTERVAL
            event = self._next()
            if isinstance(event, _Joined):
                self._name(event.link, missing)
            elif isinstance(event, _Lost):
                failure = self._mark_lost(event)
                if event.link.name is not None:
                    raise DtrainError(f"host {failure.host} {failure.how} before the job started")
        return [self._host(name) for name in names]

    def lost_hosts(self) -> list[str]:
        return [name for name, link in self.links.items() if link.gone]

    def forget(self, names: Sequence[str]) -> None:
        """Free the names of lost hosts, for new agents to take."""
        for name in names:
            del self.links[name]

    def _name(self, link: _Link, missing: list[str]) -> None:
        wanted = link.hello.get("host")
        if wanted is not None and wanted not in missing:
            taken = "has joined already" if wanted in self.links else "is not a host of this job"
            self._refuse(link, f"host {wanted!r} {taken} (missing: {', '.join(missing) or 'none'})")
            return
        if not missing:
            self._refuse(link, "the job has all its hosts already")
            return
        link.name = wanted or missing[0]
        self.links[link.name] = link
        self.say(
            f"{link.name} joined: {link.address} ({link.hello['interface']}) on "
            f"{link.hello['hostname']}, agent pid {link.hello['pid']}"
        )

    def _refuse(self, link: _Link, why: str) -> None:
        self.say(f"refused an agent from {link.address}: {why}")
        with contextlib.suppress(ConnectionClosed):
            link.connection.send("refused", reason=why)
        link.gone = True
        link.connection.close()

    def _host(self, name: str) -> Host:
        hello = self.links[name].hello
        return Host(
            name=name,
            address=hello["address"],
            interface=hello["interface"],
            machine=hello["machine"],
            hostname=hello["hostname"],
            cpus=int(hello["cpus"]),
            gpus=int(hello["gpus"]),
            home=hello["home"],
            pid=int(hello["pid"]),
        )

    def _await(self, kind: str, hosts: Sequence[str], phase: str) -> dict[str, Message]:
        """Wait for ``kind`` from each of ``hosts``; an error or a lost host fails the job."""
        replies: dict[str, Message] = {}
        while len(replies) < len(hosts):
            self._check_stop()
            event = self._next()
            if isinstance(event, _Lost):
                failure = self._mark_lost(event)
                raise DtrainError(f"{phase}: host {failure.host} {failure.how}")
            if isinstance(event, _Received):
                name = event.link.name
                if event.message.kind == "error":
                    raise DtrainError(f"{phase}: {name}: {event.message['message']}")
                if event.message.kind == "leaving":
                    raise DtrainError(f"{phase}: host {name} left: {event.message['reason']}")
                if event.message.kind == kind and name in hosts:
                    replies[name] = event.message
        return replies

    def prepare(
        self,
        plan: LaunchPlan,
        code: Callable[[Connection], None],
        hosts: Sequence[str] | None = None,
    ) -> None:
        """``hosts`` (default: all) lay out their folders; ``code`` sends the ``code`` stream.

        A host prepared again (a replacement) keeps what its folder holds (``model/``,
        ``checkpoints/``, ``output/``) and gets fresh code, configuration and channels.
        """
        names = list(hosts) if hosts is not None else plan.host_names
        for index, host in enumerate(plan.hosts):
            if host.name not in names:
                continue
            connection = self.links[host.name].connection
            folder = plan.host_folder(index)
            connection.send(
                "prepare",
                root=str(folder.root),
                config=plan.host_config(index),
                channels=[dataclasses.asdict(channel) for channel in plan.spec.channels],
                host_index=index,
                host_count=len(plan.hosts),
                environment=plan.spec.environment,
                checkpoint_dir=str(plan.checkpoint_dir(index)),
                again=hosts is not None,
            )
            code(connection)
        self._await("prepared", names, "laying out the hosts")

    def open_store(self, attempt: int, host: str) -> int:
        """Ask ``host`` (algo-1) to host the attempt's rendezvous store; its port."""
        self.links[host].connection.send("open_store", attempt=attempt)
        return int(self._await("store", [host], "opening the rendezvous store")[host]["port"])

    def run_attempt(self, attempt: Attempt, plan: LaunchPlan, master_port: int) -> Outcome:
        """Start every rank, watch until every host is done or lost, stop all at the first end."""
        for index, host in enumerate(plan.hosts):
            self.links[host.name].connection.send(
                "start",
                attempt=attempt.number,
                entry_point=plan.entry_point_name,
                arguments=plan.arguments,
                ranks={
                    str(rank): plan.rank_env(rank, master_port, attempt.number)
                    for rank in plan.ranks_of(index)
                },
                defaults=plan.defaults(index),
            )
        stop_deadline: float | None = None
        while not attempt.ended:
            stop = self.should_stop()
            if stop is not None and attempt.request_stop(*stop):
                stop_deadline = self._stop_all(attempt)
            event = self._next()
            if self._handle(attempt, event):
                stop_deadline = self._stop_all(attempt)
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                for name in attempt.hosts:
                    link = self.links[name]
                    if not link.gone and name not in attempt.done_hosts:
                        why = f"did not confirm its ranks ended within {STOP_CONFIRM_LIMIT:g} s"
                        attempt.host_lost(self._mark_lost(_Lost(link, why, time.time())))
        return attempt.outcome()

    def _handle(self, attempt: Attempt, event: _Event | None) -> bool:
        """Apply one report to ``attempt``; whether every host must now be stopped."""
        if isinstance(event, _Lost):
            return attempt.host_lost(self._mark_lost(event))
        if not isinstance(event, _Received) or event.link.name is None:
            return False
        name, message = event.link.name, event.message
        if message.kind == "leaving":
            return attempt.host_lost(
                self._mark_lost(_Lost(event.link, message["reason"], time.time()))
            )
        if message.kind == "error":
            failure = Failure(name, None, time.time(), f"failed: {message['message']}")
            return attempt.host_lost(failure)
        if message.fields.get("attempt") != attempt.number:
            return False  # a late report of an earlier attempt
        if message.kind == "exited":
            code = int(message["code"])
            failure = (
                rank_failure(name, int(message["rank"]), code, message["time"], message["tail"])
                if code != 0
                else None
            )
            return attempt.rank_exited(failure, bool(message["stopped"]))
        if message.kind == "done":
            attempt.host_done(name)
        return False

    def _stop_all(self, attempt: Attempt) -> float:
        for name in attempt.hosts:
            link = self.links[name]
            if not link.gone:
                with contextlib.suppress(ConnectionClosed):
                    link.connection.send("stop", attempt=attempt.number)
        return time.monotonic() + STOP_CONFIRM_LIMIT

    def collect(
        self,
        stream: str,
        hosts: Sequence[str],
        target: tarfile.TarFile,
        check: Callable[[], None],
    ) -> None:
        """Pack each host's ``stream`` folder (``model``, ``output``) into ``target``, in order.

        The first host to have a name wins, as in SageMaker's merged ``model.tar.gz``. ``check``
        is called as chunks arrive and may raise to give up (a new stop request).
        """
        seen: set[str] = set()
        for name in hosts:
            link = self.links[name]
            if link.gone:
                raise DtrainError(f"cannot collect {stream}/ from {name}: it was lost")
            reader = link.streams[stream] = ChunkReader(check=check)
            link.connection.send("send", stream=stream)
            try:
                repack(reader, target, seen)
                reader.drain()  # the stream's padding and end follow the archive's last member
            except (ConnectionClosed, ProtocolError, tarfile.TarError) as error:
                raise DtrainError(f"cannot collect {stream}/ from {name}: {error}") from None
            finally:
                del link.streams[stream]

    def close(self) -> None:
        """Dismiss every agent (each ends its ranks and exits) and stop listening."""
        self._closed.set()
        self.listener.close()
        for link in self.links.values():
            if not link.gone:
                with contextlib.suppress(ConnectionClosed):
                    link.connection.send("bye")
            link.connection.close()

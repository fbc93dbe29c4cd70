"""The controller's side of the hosts, phase by phase: gather their agents, have them lay out
their folders, run each attempt to its end, collect their results.

The phases run on the job's thread (:mod:`job`) and consume what the agents report
(:mod:`links`); a host that went silent, closed its connection, took nothing sent to it for too
long or was reported dead by its cluster engine shows up as lost in whatever phase that happens,
and a stop request ends any phase.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError
from dtrain.launch.clusters.base import Cluster
from dtrain.launch.env import Host, LaunchPlan
from dtrain.launch.links import Event, Joined, Link, Links, Lost, Received, lost_reason
from dtrain.launch.outcome import Attempt, Failure, Outcome, rank_failure
from dtrain.launch.transfer import (
    ChunkReader,
    Skipped,
    TransferStalled,
    repack,
    unpack_files,
)
from dtrain.launch.wire import (
    SILENCE_LIMIT,
    Connection,
    ConnectionClosed,
    Message,
    ProtocolError,
    shown,
)

STOP_CONFIRM_LIMIT = 15.0
"""How long stopped hosts have to confirm that all their ranks ended before they count as lost."""
WAITING_NOTICE_INTERVAL = 15.0


class JobStopped(DtrainError):
    """A stop request (Ctrl-C, ``dtrain stop``, ``--max-run``) came before training."""

    def __init__(self, secondary_status: str, message: str) -> None:
        self.secondary_status = secondary_status
        super().__init__(message)


class Controller:
    """Listens on ``listener`` for the job's agents; ``on_output(host, attempt, rank, lines,
    frame)`` gets ``[time, line]`` pairs and the rank's progress line being drawn;
    ``on_copied(host, channel, done, total, final)``, if given, hears the hosts' channel copies
    (:func:`~dtrain.jobs.channels.materialize_channel`; total 0: not known)."""

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        cluster: Cluster,
        on_output: Callable[[str, int, int, list[list[Any]], str | None], None],
        say: Callable[[str], None],
        should_stop: Callable[[], tuple[str, str] | None],
        on_copied: Callable[[str, str, int, int, bool], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.say = say
        self.should_stop = should_stop
        self.on_copied = on_copied
        self.links = Links(listener, secret, on_output, say)
        self.hosts = self.links.by_name

    def _next(self, timeout: float = 0.1, joining: bool = False) -> Event | None:
        """The next report; hosts the cluster engine saw end come out as lost, and an agent
        joining while the job is not ``joining`` (gathering hosts) is refused."""
        for host, reason in self.cluster.lost():
            link = self.hosts.get(host)
            if link is not None and not link.gone:
                return Lost(link, reason, time.time())
        event = self.links.next(timeout)
        if isinstance(event, Joined) and not joining:
            self._refuse(event.link, "the job has all its hosts already")
            return None
        return event

    def _check_stop(self) -> None:
        stop = self.should_stop()
        if stop is not None:
            raise JobStopped(*stop)

    @staticmethod
    def _lost(link: Link, error: Exception) -> Failure:
        """``link``'s host, whose connection failed with ``error``, marked lost."""
        return Links.mark_lost(Lost(link, lost_reason(link, error), time.time()))

    @staticmethod
    def _failed(phase: str, lost: Failure) -> DtrainError:
        return DtrainError(f"{phase}: host {lost.host} {lost.how}")

    def _order(self, name: str, phase: str, kind: str, **fields: Any) -> None:
        """Send ``kind`` to host ``name``; a host that cannot take it is lost, failing ``phase``."""
        link = self.hosts[name]
        try:
            link.connection.send(kind, **fields)
        except ConnectionClosed as error:
            raise self._failed(phase, self._lost(link, error)) from None

    # --- phases ------------------------------------------------------------------------------

    def gather(self, names: Sequence[str], timeout: float) -> list[Host]:
        """Wait until an agent holds each of ``names``; an agent may ask for its name.

        Hosts that hold their name already keep it: after :meth:`forget`, only the forgotten
        ones are waited for. Once every name is held, connections are turned away at once.
        """
        deadline = time.monotonic() + timeout
        notice = time.monotonic() + WAITING_NOTICE_INTERVAL
        while missing := [name for name in names if name not in self.hosts]:
            self._check_stop()
            now = time.monotonic()
            if now > deadline:
                raise DtrainError(f"host(s) {', '.join(missing)} did not join within {timeout:g} s")
            if now > notice:
                joined = f"{len(self.hosts)} of {len(names)} joined"
                self.say(f"waiting for {', '.join(missing)} ({joined})")
                notice = now + WAITING_NOTICE_INTERVAL
            event = self._next(joining=True)
            if isinstance(event, Joined):
                self._name(event.link, missing)
            elif isinstance(event, Lost):
                failure = Links.mark_lost(event)
                if event.link.name is not None:
                    raise DtrainError(f"host {failure.host} {failure.how} before the job started")
        self.links.awaiting.clear()
        return [self._host(name) for name in names]

    def lost_hosts(self) -> list[str]:
        return [name for name, link in self.hosts.items() if link.gone]

    def forget(self, names: Sequence[str]) -> None:
        """Free the names of lost hosts, for new agents to take."""
        for name in names:
            del self.hosts[name]
        self.links.awaiting.set()

    def _name(self, link: Link, missing: list[str]) -> None:
        wanted = link.facts["host"]
        if wanted is not None and wanted not in missing:
            taken = "has joined already" if wanted in self.hosts else "is not a host of this job"
            self._refuse(link, f"host {wanted!r} {taken} (missing: {', '.join(missing) or 'none'})")
            return
        link.name = wanted or missing[0]
        self.hosts[link.name] = link
        facts = link.facts
        self.say(
            f"{link.name} joined: {link.address} ({shown(facts['interface'], 40)}) on "
            f"{shown(facts['hostname'], 100)}, agent pid {facts['pid']}"
        )

    def _refuse(self, link: Link, why: str) -> None:
        self.say(f"refused an agent from {link.address}: {why}")
        with contextlib.suppress(ConnectionClosed):
            link.connection.send("refused", wait=False, reason=why)
        link.gone = True
        link.connection.close()

    def _host(self, name: str) -> Host:
        facts = self.hosts[name].facts
        return Host(
            name=name,
            address=facts["address"],
            interface=facts["interface"],
            machine=facts["machine"],
            hostname=facts["hostname"],
            cpus=facts["cpus"],
            gpus=facts["gpus"],
            home=facts["home"],
            pid=facts["pid"],
        )

    def _await(self, kind: str, hosts: Sequence[str], phase: str) -> dict[str, Message]:
        """Wait for ``kind`` from each of ``hosts``; an error or a lost host fails the job."""
        replies: dict[str, Message] = {}
        while len(replies) < len(hosts):
            self._check_stop()
            event = self._next()
            if isinstance(event, Lost):
                raise self._failed(phase, Links.mark_lost(event))
            if isinstance(event, Received):
                name = event.link.name
                if event.message.kind == "error":
                    raise DtrainError(f"{phase}: {name}: {shown(event.message['message'])}")
                if event.message.kind == "leaving":
                    raise DtrainError(
                        f"{phase}: host {name} left: {shown(event.message['reason'])}"
                    )
                if event.message.kind == kind and name is not None and name in hosts:
                    replies[name] = event.message
                if event.message.kind == "copied" and self.on_copied is not None and name:
                    copied = event.message
                    self.on_copied(
                        name, copied["channel"], copied["done"], copied["total"], copied["final"]
                    )
        return replies

    def prepare(
        self,
        plan: LaunchPlan,
        code: Callable[[Connection, Callable[[], None]], None],
        hosts: Sequence[str] | None = None,
    ) -> None:
        """``hosts`` (default: all) lay out their folders; ``code(connection, check)`` sends the
        ``code`` stream, calling ``check`` (which raises on a stop request) as it goes.

        A host prepared again (a replacement) keeps what its folder holds (``model/``,
        ``checkpoints/``, ``output/``) and gets fresh code, configuration and channels.
        """
        names = list(hosts) if hosts is not None else plan.host_names
        phase = "laying out the hosts"
        for index, host in enumerate(plan.hosts):
            if host.name not in names:
                continue
            link = self.hosts[host.name]
            folder = plan.host_folder(index)
            self._order(
                host.name,
                phase,
                "prepare",
                root=str(folder.root),
                config=plan.host_config(index),
                channels=[dataclasses.asdict(channel) for channel in plan.spec.channels],
                host_index=index,
                host_count=len(plan.hosts),
                environment=plan.spec.environment,
                checkpoint_dir=str(plan.checkpoint_dir(index)),
                tensorboard_dir=str(plan.tensorboard_dir(index)),
                progress=self.on_copied is not None,
                again=hosts is not None,
                job_name=plan.spec.job_name,
                key_salt=plan.spec.key_salt,
            )
            try:
                code(link.connection, self._check_stop)
            except ConnectionClosed as error:
                raise self._failed(phase, self._lost(link, error)) from None
        self._await("prepared", names, phase)

    def open_store(self, attempt: int, host: str) -> int:
        """Ask ``host`` (algo-1) to host the attempt's rendezvous store; its port."""
        phase = "opening the rendezvous store"
        self._order(host, phase, "open_store", attempt=attempt)
        return self._await("store", [host], phase)[host]["port"]

    def close_store(self, attempt: int, host: str) -> None:
        """Have ``host`` close the attempt's rendezvous store once the attempt has ended: it
        admits whoever reaches its port."""
        link = self.hosts[host]
        if not link.gone:
            with contextlib.suppress(ConnectionClosed):
                link.connection.send("close_store", attempt=attempt)

    def run_attempt(self, attempt: Attempt, plan: LaunchPlan, master_port: int) -> Outcome:
        """Start every rank, watch until every host is done or lost, stop all at the first end."""
        stop_deadline: float | None = None
        for index, host in enumerate(plan.hosts):
            link = self.hosts[host.name]
            link.ranks[attempt.number] = frozenset(plan.ranks_of(index))  # before any report
            try:
                link.connection.send(
                    "start",
                    attempt=attempt.number,
                    entry_point=plan.entry_point_name,
                    module=plan.spec.module,
                    arguments=plan.arguments,
                    ranks={
                        str(rank): plan.rank_env(rank, master_port, attempt.number)
                        for rank in plan.ranks_of(index)
                    },
                    defaults=plan.defaults(index),
                )
            except ConnectionClosed as error:
                if attempt.host_lost(self._lost(link, error)):
                    stop_deadline = self._stop_all(attempt)
        while not attempt.ended:
            stop = self.should_stop()
            if stop is not None and attempt.request_stop(*stop):
                stop_deadline = self._stop_all(attempt)
            event = self._next()
            if self._handle(attempt, event):
                stop_deadline = self._stop_all(attempt)
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                for name in attempt.hosts:
                    link = self.hosts[name]
                    if not link.gone and name not in attempt.done_hosts:
                        why = f"did not confirm its ranks ended within {STOP_CONFIRM_LIMIT:g} s"
                        attempt.host_lost(Links.mark_lost(Lost(link, why, time.time())))
        return attempt.outcome()

    def _handle(self, attempt: Attempt, event: Event | None) -> bool:
        """Apply one report to ``attempt``; whether every host must now be stopped."""
        if isinstance(event, Lost):
            return attempt.host_lost(Links.mark_lost(event))
        if not isinstance(event, Received) or event.link.name is None:
            return False
        name, message = event.link.name, event.message
        if message.kind == "leaving":
            return attempt.host_lost(
                Links.mark_lost(Lost(event.link, shown(message["reason"]), time.time()))
            )
        if message.kind == "error":
            failure = Failure(name, None, time.time(), f"failed: {shown(message['message'])}")
            return attempt.host_lost(failure)
        if message.fields.get("attempt") != attempt.number:
            return False  # a late report of an earlier attempt
        if message.kind == "exited":
            code = message["code"]
            tail = "\n".join(shown(line, None) for line in message["tail"].splitlines())
            failed = (
                rank_failure(name, message["rank"], code, message["time"], tail)
                if code != 0
                else None
            )
            return attempt.rank_exited(failed, message["stopped"])
        if message.kind == "done":
            attempt.host_done(name)
        return False

    def _stop_all(self, attempt: Attempt) -> float:
        for name in attempt.hosts:
            link = self.hosts[name]
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
            self._receive(
                stream, name, check, lambda reader, skipped: repack(reader, target, seen, skipped)
            )

    def fetch(self, stream: str, host: str, folder: Path, check: Callable[[], None]) -> None:
        """Unpack ``host``'s ``stream`` folder (``tensorboard``) into ``folder``."""
        self._receive(
            stream, host, check, lambda reader, skipped: unpack_files(reader, folder, skipped)
        )

    def _receive(
        self,
        stream: str,
        name: str,
        check: Callable[[], None],
        consume: Callable[[ChunkReader, Skipped], None],
    ) -> None:
        """Ask host ``name`` for its ``stream`` folder and hand the tar stream to ``consume``,
        with what says each member it skips (a link: only regular files are collected).

        Whatever ends the collection early (a member that cannot be written, a stop request, a
        host that sends nothing of it for :data:`SILENCE_LIMIT`) leaves the rest of the stream
        to be dropped as it comes: the host's next stream starts in step.
        """
        link = self.hosts[name]
        cannot = f"cannot collect {stream}/ from {name}"

        def skipped(member: str, kind: str) -> None:
            self.say(f"{stream}/{shown(member)} of {name} not collected: {shown(kind)}")

        if link.gone:
            raise DtrainError(f"{cannot}: it was lost")
        try:
            reader = link.streams.open(stream, check, SILENCE_LIMIT)
        except ProtocolError as error:
            raise DtrainError(f"{cannot}: {error}") from None
        try:
            try:
                link.connection.send("send", stream=stream)
            except ConnectionClosed as error:
                raise ConnectionClosed(lost_reason(link, error)) from None
            consume(reader, skipped)
            reader.drain()  # the stream's padding and end follow the archive's last member
        except TransferStalled as error:
            raise DtrainError(f"{cannot}: its agent {error}") from None
        except ConnectionClosed as error:  # the reason the host was lost
            raise DtrainError(f"{cannot}: it was lost: {error}") from None
        except (ProtocolError, tarfile.TarError, OSError) as error:  # OSError: a file not written
            raise DtrainError(f"{cannot}: {shown(error)}") from None
        finally:
            reader.abandon()

    def close(self) -> None:
        """Dismiss every agent (each ends its ranks and exits) and stop listening."""
        self.links.close()

"""``dtrain agent``: one machine's share of a job, run on the controller's orders.

An agent joins the job's controller (each proving the job's secret; it retries until its connect
timeout, so a stranger on the port or a controller not yet awaiting hosts does not end it),
reports what its machine is, then lays out its host's ``/opt/ml``-style folder (code,
configuration, its shard of each channel), starts and watches its P ranks for each attempt,
streams their output line by line, reports each exit with the rank's last traceback, hosts the
rendezvous store if it is ``algo-1``, and sends back its ``model/`` and ``output/data`` at the
end. It ends its ranks, and exits, when the job
ends, when told to stop, when it is stopped itself (SIGTERM, Ctrl-C), and when the controller goes
silent or away; if it is killed outright, its ranks die with it and its keeper ends what they
started. An agent that fails for any other reason sends its error to the controller before it
goes, so the job's failure reason names it.

Nothing here decides what the job does next: that is the controller's (:mod:`controller`).

dtrain starts an agent as ``python -m dtrain.launch.agent`` (:func:`spawn_agent`); a person
types ``dtrain agent`` (the same :func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from dtrain.compat import shim_pythonpath_entry
from dtrain.errors import DtrainError
from dtrain.exits import EXIT_BAD_INPUT
from dtrain.jobkey import KEY_ENV, derive_key
from dtrain.jobs.channels import materialize_channel
from dtrain.jobs.folder import HostFolder, make_private_dirs
from dtrain.jobs.spec import ChannelSpec
from dtrain.launch import entry
from dtrain.launch.handshake import AuthenticationError, join_controller
from dtrain.launch.machine import host_facts
from dtrain.launch.netif import format_endpoint, interface_of, parse_endpoint
from dtrain.launch.processes import become_subreaper
from dtrain.launch.ranks import LocalRanks, RankLaunch
from dtrain.launch.rendezvous import RendezvousStore
from dtrain.launch.transfer import ChunkReader, send_folder, unpack
from dtrain.launch.wire import (
    FROM_CONTROLLER,
    HEARTBEAT_INTERVAL,
    SILENCE_LIMIT,
    Connection,
    ConnectionClosed,
    ProtocolError,
    read_secret,
    shown,
)

INTERPRETER_DIR = str(Path(sys.executable).parent)
RETRY_INTERVAL = 0.1
RETRY_INTERVAL_LIMIT = 2.0
"""Joining is retried after 0.1 s, then twice as long each time, up to this."""
MARKER = "DTRAIN_AGENT"
"""The environment variable that marks everything this agent's ranks start."""
OUTBOX_LIMIT = 100_000
"""Output lines waiting to be sent before a rank's writes block: backpressure, never loss."""
COPY_REPORT_INTERVAL = 0.25
"""Least seconds between two reports of a channel copy's progress (the last one always goes)."""


def entry_command(entry_point: str, module: bool) -> list[str]:
    """How SageMaker's toolkit starts an entry point: Python files (and ``module``, a module of
    the code) with this agent's Python, through :mod:`dtrain.launch.entry` (as ``python script.py``
    or ``python -m module`` would, without the interpreter shutdown that can abort a finished
    rank)."""
    runner = [sys.executable, "-u", "-m", "dtrain.launch.entry"]
    if module:
        return [*runner, "-m", entry_point]
    if entry_point.endswith(".py"):
        return [*runner, entry_point]
    if entry_point.endswith(".sh"):
        return ["/bin/sh", entry_point]
    return [f"./{entry_point}"]


def join(
    controller: tuple[str, int],
    secret: bytes,
    address: str | None,
    host: str | None,
    timeout: float,
    say: Callable[[str], None],
) -> Connection:
    """A connection to the controller, both sides proven, this machine's facts told.

    Tried again until ``timeout`` whatever went wrong (no controller yet, one not awaiting hosts,
    a stranger's answer: none of that can be trusted to mean the job is over); what went wrong is
    said once each time it changes.
    """
    where = format_endpoint(*controller)
    deadline = time.monotonic() + timeout
    delay = RETRY_INTERVAL
    facts: dict[str, Any] = {}
    said = ""
    while True:
        try:
            sock = socket.create_connection(
                controller, timeout=5.0, source_address=(address, 0) if address else None
            )
        except OSError as error:
            why = str(error)
        else:
            connection = Connection(sock, FROM_CONTROLLER)
            own_address = address or sock.getsockname()[0]
            if facts.get("address") != own_address:
                facts = host_facts(own_address, host)
            try:
                join_controller(connection, secret, facts)
                return connection
            except (AuthenticationError, ProtocolError, ConnectionClosed) as error:
                connection.close()
                why = str(error)
        if time.monotonic() + delay > deadline:
            raise DtrainError(
                f"could not join the controller at {where} within {timeout:g} s: {why}"
            )
        if why != said:
            say(f"cannot join the controller at {where} yet ({why}); trying again")
            said = why
        time.sleep(delay)
        delay = min(delay * 2, RETRY_INTERVAL_LIMIT)


class _Outbox:
    """Output of every rank, waiting for the main loop to send it in batches: lines with the time
    each was read, and each rank's progress line being drawn, when it changed."""

    def __init__(self) -> None:
        self._lines: list[tuple[int, float, str]] = []
        self._frames: dict[int, str | None] = {}
        self._sent_frames: dict[int, str | None] = {}
        self._room = threading.Condition()

    def put(self, rank: int, line: str) -> None:
        now = time.time()
        with self._room:
            self._room.wait_for(lambda: len(self._lines) < OUTBOX_LIMIT)
            self._lines.append((rank, now, line))

    def frame(self, rank: int, frame: str | None) -> None:
        with self._room:
            self._frames[rank] = frame

    def take(self) -> dict[int, tuple[list[tuple[float, str]], str | None]]:
        """Per rank with news: its ``[time, line]`` pairs and its progress line."""
        with self._room:
            lines, self._lines = self._lines, []
            frames = dict(self._frames)
            self._room.notify_all()
        batches: dict[int, tuple[list[tuple[float, str]], str | None]] = {}
        for rank, when, line in lines:
            batches.setdefault(rank, ([], frames.get(rank)))[0].append((when, line))
        for rank, frame in frames.items():
            if frame != self._sent_frames.get(rank):
                batches.setdefault(rank, ([], frame))
        self._sent_frames = frames
        return batches


def silent_reason() -> str:
    return f"no word from the controller for {SILENCE_LIMIT:g} s"


@dataclasses.dataclass
class _Inbox:
    """Messages from the controller, read by one thread; tar streams are routed to their reader."""

    connection: Connection
    messages: queue.Queue[Any] = dataclasses.field(default_factory=queue.Queue)
    streams: dict[str, ChunkReader] = dataclasses.field(default_factory=dict)
    last_heard: float = dataclasses.field(default_factory=time.monotonic)
    feeding: bool = False
    """The reader waits for room to hand on a chunk: this agent is slow, not the controller."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def stream(self, name: str) -> ChunkReader:
        with self.lock:
            return self.streams.setdefault(name, ChunkReader(check=self.check_silence))

    def silent(self) -> bool:
        """Whether the controller has not been heard of for too long (it or its link is down)."""
        return not self.feeding and time.monotonic() - self.last_heard > SILENCE_LIMIT

    def check_silence(self) -> None:
        if self.silent():
            raise ConnectionClosed(silent_reason())

    def read(self) -> None:
        try:
            while True:
                message = self.connection.receive()
                self.last_heard = time.monotonic()
                if message.kind in ("chunk", "end"):
                    self.feeding = True
                    try:
                        chunk = message.payload if message.kind == "chunk" else b""
                        self.stream(message["stream"]).feed(chunk)
                    finally:
                        self.feeding = False
                        self.last_heard = time.monotonic()
                elif message.kind != "heartbeat":
                    self.messages.put(message)
        except Exception as error:
            with self.lock:
                for reader in self.streams.values():
                    reader.fail(ConnectionClosed(str(error)))
            # A message the protocol does not allow is the controller's bug: the agent reports it.
            self.messages.put(
                error if isinstance(error, ProtocolError) else ConnectionClosed(str(error))
            )


class Agent:
    """Runs one host's share of a job over an admitted connection to the controller."""

    def __init__(
        self,
        connection: Connection,
        say: Callable[[str], None],
        marker: str,
        keeper: int,
        secret: bytes,
    ) -> None:
        self.connection = connection
        connection.stall_limit = None  # the heartbeat thread ends a send to a silent controller
        self.secret = secret
        """The job's: the ranks' key is derived from it here, so it never travels."""
        self.key_context = ("", "")
        """The job's name and salt, bound into the ranks' key (from ``prepare``)."""
        self.say = say
        self.marker = marker
        self.keeper = keeper
        self.inbox = _Inbox(connection)
        self.outbox = _Outbox()
        self.ranks: LocalRanks | None = None
        self.attempt = 0
        self.folder: HostFolder | None = None
        self.tensorboard_dir: Path | None = None
        """The host's ``TensorBoardOutputConfig.LocalPath`` (from ``prepare``)."""
        self.store: RendezvousStore | None = None
        self.address = connection.sock.getsockname()[0]
        self._signalled: str | None = None
        self._alive = True

    def run(self) -> int:
        """Serve the controller until it dismisses this agent; ``dtrain agent``'s exit status."""
        become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self.serve()

    def serve(self) -> int:
        """Read and obey the controller's messages; an unexpected error goes to the controller
        (type and message) before it ends the agent, so the job's failure reason names it."""
        threading.Thread(target=self.inbox.read, name="agent-inbox", daemon=True).start()
        threading.Thread(target=self._beat, name="agent-heartbeat", daemon=True).start()
        try:
            return self._serve()
        except ConnectionClosed as error:
            self.say(f"lost the controller ({error}); stopping this host's ranks")
            return 1
        except Exception as error:
            reason = shown(f"{type(error).__name__}: {error}")
            with contextlib.suppress(ConnectionClosed):
                self.connection.send("error", message=f"its agent failed: {reason}")
            raise
        finally:
            self._alive = False
            self._end_ranks()
            self.connection.close()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signalled = signal.Signals(signum).name

    def _beat(self) -> None:
        """A heartbeat a second, unless a frame is going out (it shows the controller this agent
        lives) or the controller has no room for one: never waits on the controller. A
        controller unheard of for too long has the connection ended, which wakes a send waiting
        on it (this agent's sends wait as long as the controller is heard: it may be slow to
        take a folder, as its upload is)."""
        while self._alive:
            if self.inbox.silent():
                self.connection.abort(silent_reason())
                return
            try:
                self.connection.send("heartbeat", wait=False)
            except ConnectionClosed:
                return
            time.sleep(HEARTBEAT_INTERVAL)

    def _serve(self) -> int:
        while True:
            try:
                message = self.inbox.messages.get(timeout=0.05)
            except queue.Empty:
                message = None
            self._send_output()
            self._report_exits()
            if self.store is not None:
                self.store.check()
            if isinstance(message, ConnectionClosed):
                self.say(f"the controller is gone ({message}); stopping this host's ranks")
                return 1
            if isinstance(message, ProtocolError):
                raise message
            if self._signalled:
                self._end_ranks()
                self.connection.send("leaving", reason=f"its agent got {self._signalled}")
                return 1
            if self.inbox.silent():
                self.say(f"{silent_reason()}; stopping")
                return 1
            if message is None:
                continue
            if message.kind == "bye":
                return 0
            if message.kind == "refused":
                self.say(f"the controller refused this agent: {shown(message['reason'])}")
                return 1
            try:
                self._handle(message.kind, message.fields)
            except DtrainError as error:
                self.connection.send("error", message=str(error))

    def _handle(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "prepare":
            self._prepare(fields)
        elif kind == "open_store":
            self._open_store(fields["attempt"])
        elif kind == "close_store":
            self._close_store()
        elif kind == "start":
            self._start(fields)
        elif kind == "stop":
            if self.ranks is not None and fields["attempt"] == self.attempt:
                self.ranks.stop()
        elif kind == "send":
            send_folder(self.connection, fields["stream"], self._result_folder(fields["stream"]))
        else:
            raise DtrainError(f"the agent does not know the order {kind!r}")

    def _result_folder(self, stream: str) -> Path:
        """The folder a ``send`` order asks for: ``model/``, ``output/data`` or the host's
        TensorBoard ``LocalPath``."""
        assert self.folder is not None
        if stream == "tensorboard":
            assert self.tensorboard_dir is not None
            return self.tensorboard_dir
        return {"model": self.folder.model_dir, "output": self.folder.output_data_dir}[stream]

    def _prepare(self, fields: dict[str, Any]) -> None:
        """Lay out the host's folder: configuration, code, and this host's share of each channel."""
        root = Path(fields["root"])
        self.folder = folder = HostFolder(root)
        self.key_context = (fields["job_name"], fields["key_salt"])
        code = self.inbox.stream("code")
        try:
            if root.exists() and not fields["again"]:
                raise DtrainError(f"{root} already exists here; choose another job name")
            for renewed in (folder.code_dir, folder.root / "input" / "data"):
                shutil.rmtree(renewed, ignore_errors=True)  # a replacement host: fresh copies
            folder.create()
            for name, text in fields["config"].items():
                (folder.input_config_dir / name).write_text(text)
            folder.code_dir.mkdir()
            unpack(code, folder.code_dir)
            make_private_dirs(Path(fields["checkpoint_dir"]))
            self.tensorboard_dir = Path(fields["tensorboard_dir"])
            make_private_dirs(self.tensorboard_dir)
        except (OSError, tarfile.TarError) as error:
            raise DtrainError(f"cannot lay out {root} on {self.address}: {error}") from None
        finally:
            code.drain()  # the rest of the stream, so the inbox never waits on it
            with self.inbox.lock:
                del self.inbox.streams["code"]
        os.environ.update(fields["environment"])  # the job's credentials reach its downloads too
        for channel in fields["channels"]:
            spec = ChannelSpec(**channel)
            try:
                materialize_channel(
                    spec,
                    folder.channel_dir(spec.name),
                    fields["host_index"],
                    fields["host_count"],
                    self._copy_reports(spec.name, fields["progress"]),
                )
            except DtrainError as error:
                raise DtrainError(f"{error} (on {self.address})") from None
        self.connection.send("prepared")

    def _copy_reports(self, channel: str, wanted: bool) -> Callable[[int, int | None, bool], None]:
        """Tell the controller, at most 4 times a second and once at the end, how much of
        ``channel`` this host has copied, if it ``wanted`` it: for the bars of a person watching
        ``dtrain run`` on a terminal."""
        last = 0.0

        def report(done: int, total: int | None, final: bool) -> None:
            nonlocal last
            now = time.monotonic()
            if wanted and (final or now - last >= COPY_REPORT_INTERVAL):
                last = now
                self.connection.send(
                    "copied", channel=channel, done=done, total=total or 0, final=final
                )

        return report

    def _open_store(self, attempt: int) -> None:
        """Host the attempt's rendezvous store on this host's job address, on a fresh port,
        until the controller closes it (``close_store``)."""
        self._close_store()  # the previous attempt's first
        self.store = RendezvousStore(self.address)
        self.connection.send("store", attempt=attempt, port=self.store.port)

    def _close_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def _start(self, fields: dict[str, Any]) -> None:
        assert self.folder is not None
        self._end_ranks()
        self.attempt = fields["attempt"]
        argv = [*entry_command(fields["entry_point"], fields["module"]), *fields["arguments"]]
        launches = []
        for rank, contract in fields["ranks"].items():
            env = {**os.environ, **contract, MARKER: self.marker}
            env[KEY_ENV] = derive_key(self.secret, *self.key_context, self.attempt)
            for key, value in fields["defaults"].items():
                env.setdefault(key, value)
            entries = [str(self.folder.code_dir), env.get("PYTHONPATH"), shim_pythonpath_entry()]
            env["PYTHONPATH"] = os.pathsep.join(entry for entry in entries if entry)
            # A wrapper script's `python` must be the job's interpreter, not whichever is first.
            env["PATH"] = os.pathsep.join(filter(None, (INTERPRETER_DIR, env.get("PATH"))))
            launches.append(RankLaunch(int(rank), argv, env, self.folder.code_dir))
        ranks = LocalRanks(
            launches, self.outbox.put, spare=[self.keeper], on_frame=self.outbox.frame
        )
        try:
            ranks.start()
        except OSError as error:
            ranks.stop()
            raise DtrainError(f"cannot start the ranks of this host: {error}") from None
        self.ranks = ranks

    def _send_output(self) -> None:
        for rank, (lines, frame) in self.outbox.take().items():
            self.connection.send(
                "output", attempt=self.attempt, rank=rank, lines=lines, frame=frame
            )

    def _report_exits(self) -> None:
        if self.ranks is None:
            return
        exits = self.ranks.poll()
        if not exits:
            return
        self._send_output()  # a rank's last lines go before its exit
        for rank_exit in exits:
            self.connection.send("exited", attempt=self.attempt, **dataclasses.asdict(rank_exit))
        if not self.ranks.running:
            self.connection.send("done", attempt=self.attempt)
            self.ranks = None

    def _end_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks.stop()
            try:
                self._report_exits()
            except ConnectionClosed:
                self.ranks = None


def spawn_agent(
    controller: tuple[str, int], secret: bytes, host: str, connect_timeout: float, **popen: Any
) -> subprocess.Popen[bytes]:
    """An agent for ``host`` as a child process, in a session of its own.

    The secret goes through its standard input: a command line is readable by every user.
    """
    command = [
        sys.executable, "-m", "dtrain.launch.agent", "--join", format_endpoint(*controller),
        "--secret-file", "-", "--host", host, "--connect-timeout", str(connect_timeout),
    ]  # fmt: skip
    agent = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        start_new_session=True,
        **popen,
    )
    assert agent.stdin is not None
    agent.stdin.write(secret + b"\n")
    agent.stdin.close()
    return agent


def run_agent(
    controller: tuple[str, int],
    secret: bytes,
    address: str | None = None,
    host: str | None = None,
    connect_timeout: float = 600.0,
) -> int:
    """``dtrain agent``: join the controller, serve it, and leave nothing running behind."""

    def say(message: str) -> None:
        print(f"[dtrain agent {host or os.getpid()}] {message}", file=sys.stderr, flush=True)

    if address is not None and interface_of(address) is None:
        raise DtrainError(f"--address {address} is not an address of this machine")
    connection = join(controller, secret, address, host, connect_timeout, say)
    marker = f"{os.getpid()}-{os.urandom(8).hex()}"
    keeper = subprocess.Popen(
        [sys.executable, "-m", "dtrain.launch.keeper", f"{MARKER}={marker}"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        return Agent(connection, say, marker, keeper.pid, secret).run()
    finally:
        assert keeper.stdin is not None
        keeper.stdin.close()  # the keeper sweeps once more, then exits
        keeper.wait(timeout=30)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Run one machine's share of a job.")
    parser.add_argument(
        "--join", required=True, metavar="ADDR:PORT", help="the controller's join:// address"
    )
    parser.add_argument(
        "--secret-file", required=True, help="the job's secret (- reads it from standard input)"
    )
    parser.add_argument(
        "--address",
        help="this machine's address for the job (default: the one that reaches the controller)",
    )
    parser.add_argument("--host", help="ask for this host name (algo-1 hosts the rendezvous)")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=600.0,
        help="seconds to keep trying to join the controller (whatever it or a stranger answers)",
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "dtrain.launch.agent") -> NoReturn:
    """Serve the job, then end without the interpreter's teardown: ``algo-1``'s rendezvous store
    loaded torch, and tearing torch down took 1 to 3 s here, which the controller (and so
    ``dtrain run``) waited for at the end of every job."""
    args = _parser(prog).parse_args(argv)
    try:
        controller = parse_endpoint("--join", args.join)
        secret = read_secret(args.secret_file)
        status = run_agent(controller, secret, args.address, args.host, args.connect_timeout)
    except DtrainError as error:
        print(f"dtrain: error: {error}", file=sys.stderr)
        status = EXIT_BAD_INPUT
    entry.end(status)


if __name__ == "__main__":
    main()

"""The controller's door, on loopback without processes: a slow connection, a flood, garbage and
failed accepts never keep a real agent out, and an admitted agent's reports are checked."""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dtrain.launch.agent import join
from dtrain.launch.handshake import join_controller
from dtrain.launch.links import Event, Joined, Links, Lost
from dtrain.launch.wire import FROM_CONTROLLER, PROTOCOL_VERSION, Connection
from tests.launch.peers import SECRET, facts, raw_frame

pytestmark = pytest.mark.timeout(60)
Door = tuple[Links, list[str], list[tuple[Any, ...]]]


@pytest.fixture
def door() -> Iterator[Callable[..., Door]]:
    """Links on a fresh loopback listener: the links, what they said, the output they passed on."""
    opened: list[Links] = []

    def open_door(listener: Any = None, **options: Any) -> Door:
        said: list[str] = []
        output: list[tuple[Any, ...]] = []
        listener = listener or socket.create_server(("127.0.0.1", 0))
        links = Links(listener, SECRET, lambda *line: output.append(line), said.append, **options)
        opened.append(links)
        return links, said, output

    yield open_door
    for links in opened:
        links.close()


def endpoint(links: Links) -> tuple[str, int]:
    return links.listener.getsockname()[:2]


def next_event(links: Links, timeout: float = 20) -> Event:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = links.next(timeout=0.1)
        if event is not None:
            return event
    raise AssertionError("no event")


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def said_line(said: list[str], text: str) -> Callable[[], bool]:
    return lambda: any(text in line for line in said)


def test_a_slow_connection_is_cut_at_the_hello_deadline_while_an_agent_joins(
    door: Callable[..., Door],
) -> None:
    links, said, _ = door()
    slow = socket.create_connection(endpoint(links))

    def trickle() -> None:  # one byte every tenth of a second: no read ever waits long
        with contextlib.suppress(OSError):
            for _ in range(600):
                slow.send(b"\x00")
                time.sleep(0.1)

    threading.Thread(target=trickle, daemon=True).start()
    join(endpoint(links), SECRET, None, None, 30, said.append)
    assert isinstance(next_event(links), Joined)
    slow.settimeout(20)
    with contextlib.suppress(ConnectionResetError):
        while slow.recv(4096):  # the challenge, then the end: closed at the deadline
            pass
    wait_until(said_line(said, "sent no hello within 0.5 s"))
    slow.close()


def test_a_flood_beyond_the_bound_and_garbage_keep_no_agent_out(
    door: Callable[..., Door],
) -> None:
    links, said, _ = door()
    hello = {
        "kind": "hello", "version": PROTOCOL_VERSION, "time": 0, "nonce": "0" * 32,
        "proof": "é" * 64,
    }  # fmt: skip
    garbage = [b"[" * 1000, json.dumps(hello).encode(), b'{"kind": "\xff"}', b"[" * 1025]
    strangers = [socket.create_connection(endpoint(links)) for _ in garbage]
    for stranger, body in zip(strangers, garbage, strict=True):
        stranger.sendall(raw_frame(body))
    wait_until(lambda: len(said) == len(garbage))
    for refusal in (
        "proof = 'éééé",
        "not JSON: 'utf-8' codec",
        "not JSON: maximum recursion",
        "sent a first frame over 1024 bytes",
    ):
        assert any(refusal in line and "refused a connection" in line for line in said), said
    flood = [socket.create_connection(endpoint(links)) for _ in range(40)]
    join(endpoint(links), SECRET, None, None, 30, said.append)
    assert isinstance(next_event(links), Joined)
    assert any("16 connections from 127.0.0.1 await a first frame" in line for line in said)
    for sock in strangers + flood:
        sock.close()


def test_facts_without_an_address_are_refused_and_the_next_agent_joins(
    door: Callable[..., Door],
) -> None:
    links, said, _ = door()
    stranger = Connection(socket.create_connection(endpoint(links)), FROM_CONTROLLER)
    join_controller(stranger, SECRET, {**facts(), "address": "here"})
    wait_until(said_line(said, "sent 'facts' with address = 'here'; allowed: a numeric IP"))
    join(endpoint(links), SECRET, None, None, 30, said.append)
    assert isinstance(next_event(links), Joined)


def test_no_connection_is_admitted_while_no_host_is_awaited_and_an_agent_retries(
    door: Callable[..., Door],
) -> None:
    links, _, _ = door()
    links.awaiting.clear()
    tried: list[str] = []
    joined: list[Connection] = []
    joining = threading.Thread(
        target=lambda: joined.append(join(endpoint(links), SECRET, None, None, 30, tried.append))
    )
    joining.start()
    wait_until(lambda: bool(tried))
    assert "closed the connection); trying again" in tried[0]
    links.awaiting.set()
    joining.join()
    assert joined and isinstance(next_event(links), Joined)


class FailingListener:
    """A listener whose first accepts fail, as when the process is out of descriptors."""

    def __init__(self, failures: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.failures = failures

    def accept(self) -> tuple[socket.socket, Any]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_failed_accepts_are_retried(door: Callable[..., Door]) -> None:
    links, said, _ = door(FailingListener(failures=3))
    join(endpoint(links), SECRET, None, None, 30, said.append)
    assert isinstance(next_event(links), Joined)
    assert said[0] == "cannot accept a connection ([Errno 24] Too many open files); trying again"


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        (
            {
                "kind": "output",
                "attempt": "/../../x",
                "rank": 0,
                "lines": [[0, "anywhere"]],
                "frame": None,
            },
            "'output' with attempt = '/../../x'; allowed: an integer >= 0",
        ),
        (
            {"kind": "output", "attempt": 1, "rank": 7, "lines": [[0, "another's"]], "frame": None},
            "'output' for rank 7 of attempt 1, which this host does not run",
        ),
        (
            {"kind": "done", "attempt": 2},
            "'done' for attempt 2, which this host does not run",
        ),
    ],
)
def test_a_report_must_name_an_attempt_and_a_rank_the_host_runs(
    door: Callable[..., Door], report: dict[str, Any], expected: str
) -> None:
    links, said, output = door()
    agent = join(endpoint(links), SECRET, None, None, 30, said.append)
    joined = next_event(links)
    assert isinstance(joined, Joined)
    joined.link.name, joined.link.ranks[1] = "algo-1", frozenset({0})
    agent.send(**report)
    lost = next_event(links)
    assert isinstance(lost, Lost) and lost.reason.startswith("its agent broke the protocol: ")
    assert lost.reason.endswith(expected)
    assert output == []  # nothing was written for it

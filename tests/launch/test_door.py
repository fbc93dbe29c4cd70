"""The controller's door, on loopback without processes: strangers that connect again as soon as
they are dropped, silent or not, from another address or the agent's own, keep no agent out, and
a hello seen on the path cannot be sent again."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from dtrain.launch.agent import join
from dtrain.launch.handshake import prove_hello
from dtrain.launch.links import Joined, Links
from dtrain.launch.wire import PROTOCOL_VERSION
from tests.launch.peers import SECRET, raw_frame, read_frame

pytestmark = pytest.mark.timeout(60)


class Strangers:
    """``count`` connections from ``source`` to ``target``, each made again as soon as the
    controller drops it; each sends ``first`` (nothing: silent) and waits."""

    def __init__(self, target: tuple[str, int], source: str, count: int, first: bytes) -> None:
        self.target, self.source, self.first = target, source, first
        self.connections = 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        for _ in range(count):
            self._connect()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _connect(self) -> None:
        sock = socket.socket()
        sock.bind((self.source, 0))
        sock.connect(self.target)
        sock.setblocking(False)
        if self.first:
            sock.send(self.first)
        self.connections += 1
        self._selector.register(sock, selectors.EVENT_READ)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock.recv(4096):
                        continue  # the challenge: wait on
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self._selector.unregister(sock)
                sock.close()
                self._connect()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]


@pytest.fixture
def links() -> Iterator[tuple[Links, list[str]]]:
    said: list[str] = []
    opened = Links(socket.create_server(("127.0.0.1", 0)), SECRET, lambda *line: None, said.append)
    yield opened, said
    opened.close()


GARBAGE = raw_frame({"kind": "hello", "version": PROTOCOL_VERSION})


@pytest.mark.parametrize("source", ["127.0.0.2", "127.0.0.1"], ids=["elsewhere", "agent's own"])
@pytest.mark.parametrize("first", [b"", GARBAGE], ids=["silent", "garbage"])
def test_an_agent_joins_at_once_while_forty_strangers_connect_again_as_soon_as_dropped(
    links: tuple[Links, list[str]], source: str, first: bytes
) -> None:
    door, said = links
    target = door.listener.getsockname()[:2]
    strangers = Strangers(target, source, 40, first)
    try:
        time.sleep(0.5)  # every slot a stranger could hold is held
        started = time.monotonic()
        agent = join(target, SECRET, None, None, 8, said.append)  # once slots took 10 s each
        assert time.monotonic() - started < 8
        event = door.next(timeout=5)
        assert isinstance(event, Joined)
    finally:
        strangers.stop()
    agent.close()
    assert strangers.connections > 40  # they were dropped, and came back
    assert any(line.startswith(f"refused a connection from {source}:") for line in said), said


def test_a_hello_seen_on_the_path_cannot_be_sent_again(links: tuple[Links, list[str]]) -> None:
    door, _ = links
    target = door.listener.getsockname()[:2]
    milliseconds = time.time_ns() // 1_000_000
    nonce = "5" * 32
    hello = raw_frame(
        {
            "kind": "hello", "version": PROTOCOL_VERSION, "time": milliseconds, "nonce": nonce,
            "proof": prove_hello(SECRET, milliseconds, nonce),
        }
    )  # fmt: skip
    first = socket.create_connection(target)
    first.sendall(hello)  # as the agent sent it
    assert b"challenge" in read_frame(first, sealed=False)
    assert b"welcome" in read_frame(first, sealed=False)
    replayed = socket.create_connection(target)
    replayed.sendall(hello)  # as someone on the path sends it again
    assert b"challenge" in read_frame(replayed, sealed=False)
    assert b"its hello was sent before (a replay)" in read_frame(replayed, sealed=False)
    assert replayed.recv(1) == b""  # and closed
    first.close()
    replayed.close()

"""Messages: framing, checked fields, limits, sealed frames, sends with deadlines and heartbeats
that never wait, secrets, and a peer's text shown harmless."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dtrain.errors import ConfigError
from dtrain.launch.wire import (
    HANDSHAKE_LIMIT,
    SHOWN_LIMIT,
    Connection,
    ConnectionClosed,
    ProtocolError,
    SendStalled,
    read_secret,
    shown,
)
from tests.launch.peers import (
    admitted_pair,
    raw_frame,
    read_frame,
    tcp_pair,
)

pytestmark = pytest.mark.timeout(30)


def test_messages_keep_fields_and_payload_in_order() -> None:
    controller, agent = admitted_pair()
    agent.send("output", attempt=1, rank=3, lines=[[1.5, "a"], [2, "ü"]], frame=None)
    agent.send("chunk", b"\x00" * 100_000, stream="model")
    first, second = controller.receive(), controller.receive()
    assert (first.kind, first["rank"], first["lines"], first.payload) == (
        "output",
        3,
        [[1.5, "a"], [2, "ü"]],
        b"",
    )
    assert (second.kind, second["stream"], len(second.payload)) == ("chunk", "model", 100_000)


def test_a_closed_peer_and_garbage_are_told_apart() -> None:
    receiver, sender = tcp_pair()
    sender.sock.sendall(raw_frame(b"[1]"))
    with pytest.raises(ProtocolError, match="without a kind"):
        receiver.receive()
    sender.close()
    with pytest.raises(ConnectionClosed):
        receiver.receive()


def test_an_oversized_frame_is_refused_before_it_is_read() -> None:
    receiver, sender = tcp_pair()
    sender.sock.sendall((HANDSHAKE_LIMIT + 1).to_bytes(4, "big") + b"\x00" * 4)
    with pytest.raises(ProtocolError, match="over"):
        receiver.receive(limit=HANDSHAKE_LIMIT)


def test_frames_after_the_handshake_are_sealed() -> None:
    controller, agent = admitted_pair()
    controller.send("refused", reason="AWS_SECRET_ACCESS_KEY=hunter2")
    sealed = read_frame(agent.sock)
    assert b"hunter2" not in sealed and b"refused" not in sealed


@pytest.mark.parametrize(
    ("delivered", "accepted"),
    [
        (lambda first, second: [first, first], 1),
        (lambda first, second: [second, first], 0),
        (lambda first, second: [first[:-1] + bytes([first[-1] ^ 1])], 0),
        (lambda first, second: [raw_frame({"kind": "done", "attempt": 1}) + b"\0" * 16], 0),
    ],
    ids=["replayed", "reordered", "tampered", "forged"],
)
def test_a_frame_replayed_reordered_tampered_or_forged_on_the_path_is_refused(
    delivered: Callable[[bytes, bytes], list[bytes]], accepted: int
) -> None:
    controller, agent = admitted_pair()
    agent.send("done", attempt=1)
    agent.send("done", attempt=2)
    first, second = read_frame(controller.sock), read_frame(controller.sock)
    for frame in delivered(first, second):
        agent.sock.sendall(frame)  # what someone on the path writes into the stream
    for _ in range(accepted):
        assert controller.receive()["attempt"] == 1
    with pytest.raises(ProtocolError, match=r"127\.0\.0\.1:\d+ sent a frame that fails auth"):
        controller.receive()


def test_a_peers_text_is_shown_escaped_and_capped() -> None:
    assert shown("boom\n\x1b[31mFAKE\u202e") == "boom\\n\\x1b[31mFAKE\\u202e"
    controller, agent = tcp_pair()
    controller.send("error", message="boom\n\x1b[31mFAKE" + "x" * 1000)
    with pytest.raises(ProtocolError) as raised:
        agent.expect("challenge")
    text = str(raised.value)
    assert "answered: boom\\n\\x1b[31mFAKE" in text and "\n" not in text and "\x1b" not in text
    assert text.endswith(f"... ({1014 - SHOWN_LIMIT} more characters)")


def test_a_secret_file_is_created_private_and_a_readable_or_foreign_one_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sub" / "secret"
    created = read_secret(str(path), create=True)
    assert len(created) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret(str(path)) == created
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_secret(str(path))
    os.chmod(path, 0o600)
    owner = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # the file is another user's
    with pytest.raises(ConfigError, match=f"a file of this user .*belongs to uid {owner}"):
        read_secret(str(path))
    monkeypatch.undo()
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 16"):
        read_secret(str(short))
    with pytest.raises(ConfigError, match="readable file"):
        read_secret(str(tmp_path / "missing"))


# --- sends have deadlines; heartbeats never wait -------------------------------------------


def test_a_send_the_peer_takes_nothing_of_fails_and_ends_the_connection() -> None:
    controller, agent = admitted_pair()  # the agent reads nothing from now on
    controller.stall_limit = 0.3
    started = time.monotonic()
    with pytest.raises(SendStalled, match=r"127\.0\.0\.1:\d+ took no data for 0\.3 s"):
        for _ in range(64):
            controller.send("chunk", b"\0" * (1 << 20), stream="code")
    assert time.monotonic() - started < 10
    with pytest.raises(ConnectionClosed, match="took no data"):  # a cut frame cannot go on
        controller.send("heartbeat")
    agent.close()


def test_a_heartbeat_never_waits_behind_a_stuck_frame() -> None:
    controller, agent = admitted_pair()  # the agent reads nothing
    bulk = threading.Thread(target=_fill, args=(controller,), daemon=True)
    bulk.start()
    time.sleep(0.5)  # the frame under way waits for room that never comes
    started = time.monotonic()
    assert controller.send("heartbeat", wait=False) is False  # another frame is going out
    assert time.monotonic() - started < 0.1
    controller.abort("the test is over")  # wakes the stuck send at once
    bulk.join(timeout=5)
    assert not bulk.is_alive()
    agent.close()


def _fill(connection: Connection) -> None:
    with contextlib.suppress(ConnectionClosed):
        while True:
            connection.send("chunk", b"\0" * (1 << 20), stream="code")


def test_a_heartbeat_is_skipped_while_the_socket_has_no_room() -> None:
    controller, agent = admitted_pair()  # the agent reads nothing
    while controller.send("chunk", b"\0" * 1024, wait=False, stream="code"):
        pass  # each frame fits whole while there is room: none is ever cut
    started = time.monotonic()
    assert controller.send("heartbeat", wait=False) is False
    assert time.monotonic() - started < 0.1
    agent.close()


def test_an_aborted_connection_fails_every_send_and_receive_with_its_reason() -> None:
    controller, agent = admitted_pair()
    received: list[BaseException] = []

    def receive() -> None:
        try:
            controller.receive()
        except ConnectionClosed as error:
            received.append(error)

    reader = threading.Thread(target=receive)
    reader.start()
    controller.abort("no heartbeat for 15 s")
    reader.join(timeout=5)
    assert [str(error) for error in received] == ["no heartbeat for 15 s"]
    with pytest.raises(ConnectionClosed, match=r"^no heartbeat for 15 s$"):
        controller.send("heartbeat")
    agent.close()


def test_every_character_a_console_could_act_on_is_escaped_but_a_tab() -> None:
    assert shown("a\tb\nc\r\x1b[2J\x85\u2028\u202e\ud800", None) == (
        "a\tb\\nc\\r\\x1b[2J\\x85\\u2028\\u202e\\ud800"
    )
    assert shown("x" * 1000, None) == "x" * 1000  # a rank's line is never cut

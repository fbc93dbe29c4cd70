"""Messages and the handshake that admits an agent: framing, checked fields, limits, secrets, both
proofs, sealed frames, and a peer's text shown harmless."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dtrain.errors import ConfigError
from dtrain.launch.wire import (
    HANDSHAKE_LIMIT,
    HELLO_LIMIT,
    PROTOCOL_VERSION,
    SHOWN_LIMIT,
    AuthenticationError,
    Connection,
    ConnectionClosed,
    HelloCheck,
    Message,
    ProtocolError,
    SendStalled,
    admit_agent,
    join_controller,
    prove,
    prove_hello,
    read_secret,
    shown,
)
from tests.launch.peers import (
    SECRET,
    admitted_pair,
    facts,
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


HELLO = {
    "kind": "hello", "version": PROTOCOL_VERSION, "time": 0, "nonce": "0" * 32, "proof": "0" * 64,
}  # fmt: skip


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        ({**HELLO, "proof": "é" * 64}, r"proof = 'éééé.*allowed: 64 hex digits"),
        (b"[" * 1000, "not JSON: maximum recursion depth"),
        (b"[" * 1025, f"sent a frame over {HELLO_LIMIT} bytes"),
        (b'{"kind": "hello\xff"}', "not JSON"),
        ({**HELLO, "version": float("nan")}, "not JSON: NaN is not a number JSON allows"),
        ({"kind": "hello"}, "hello' with version = nothing"),
        ({**HELLO, "version": "2"}, "version = '2'; allowed: an integer"),
        ({**HELLO, "time": 1.5}, "time = 1.5; allowed: an integer >= 0"),
        ({"kind": "\x1b[31mred"}, r"unknown kind '\\x1b\[31mred'"),
        ({"kind": "output", "attempt": 1, "rank": 0, "lines": [], "frame": None},
         "'output' where 'hello'"),
    ],
)  # fmt: skip
def test_garbage_in_the_handshake_is_refused_cleanly(frame: dict | bytes, expected: str) -> None:
    controller, stranger = tcp_pair()
    stranger.sock.sendall(raw_frame(frame))
    with pytest.raises(ProtocolError, match=expected):
        admit_agent(controller, SECRET)


def handshake(
    agent_secret: bytes, controller_secret: bytes, agent_facts: dict | None = None
) -> tuple[object, object]:
    controller, agent = tcp_pair()
    results: dict[str, object] = {}

    def admit() -> None:
        try:
            results["controller"] = admit_agent(controller, controller_secret)
        except Exception as error:
            results["controller"] = error
            controller.close()

    thread = threading.Thread(target=admit)
    thread.start()
    try:
        join_controller(agent, agent_secret, facts() if agent_facts is None else agent_facts)
        results["agent"] = "joined"
    except Exception as error:
        results["agent"] = error
    thread.join()
    return results["controller"], results["agent"]


def test_both_sides_prove_the_secret_and_the_agent_tells_its_facts() -> None:
    told, joined = handshake(SECRET, SECRET)
    assert joined == "joined" and told.kind == "facts" and told.fields == facts()


def test_an_agent_without_the_secret_is_refused_and_told_why() -> None:
    refused, told = handshake(b"x" * 64, SECRET)
    assert isinstance(refused, AuthenticationError) and str(refused) == "wrong secret"
    assert isinstance(told, ProtocolError)
    assert "answered: the controller refused this agent: wrong secret" in str(told)


@pytest.mark.parametrize("address", [None, 2130706433, "here"])
def test_facts_without_a_usable_address_are_refused(address: object) -> None:
    refused, _ = handshake(SECRET, SECRET, {**facts(), "address": address})
    assert isinstance(refused, ProtocolError)
    assert f"'facts' with address = {address!r}; allowed: a numeric IP address" in str(refused)


@pytest.mark.parametrize(
    "welcome",
    [
        lambda hello: prove(b"guess" * 8, "controller", "0" * 32, hello["nonce"]),
        lambda hello: hello["proof"],  # the agent's own proof, reflected
        lambda hello: prove(SECRET, "controller", "1" * 32, hello["nonce"]),  # another handshake
    ],
    ids=["guessed", "reflected", "replayed"],
)
def test_an_impostor_controller_is_found_out_before_the_agent_tells_anything(
    welcome: Callable[[dict], str],
) -> None:
    controller, agent = tcp_pair()
    heard: list[dict] = []

    def impostor() -> None:
        controller.send("challenge", nonce="0" * 32, version=PROTOCOL_VERSION)
        hello = json.loads(read_frame(controller.sock, sealed=False)[8:])
        heard.append(hello)
        controller.send("welcome", proof=welcome(hello))

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(AuthenticationError, match="could not prove the job's secret"):
        join_controller(agent, SECRET, facts())
    thread.join()
    assert set(heard[0]) == {"kind", "version", "time", "nonce", "proof"}  # no facts before


def test_an_agent_of_another_version_is_told_to_install_the_same() -> None:
    controller, agent = tcp_pair()
    old = PROTOCOL_VERSION - 1
    controller.send("challenge", nonce="0" * 32, version=old)
    expected = f"speaks protocol {old}, this dtrain {PROTOCOL_VERSION}: install"
    with pytest.raises(AuthenticationError, match=expected):
        join_controller(agent, SECRET, facts())


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


# --- the agent's first frame: fresh, once, from a clock near the controller's -----------------


def hello(secret: bytes = SECRET, seconds: float = 1_000_000.0, nonce: str = "a" * 32) -> Message:
    milliseconds = int(seconds * 1000)
    proof = prove_hello(secret, milliseconds, nonce)
    fields = {"version": PROTOCOL_VERSION, "time": milliseconds, "nonce": nonce, "proof": proof}
    return Message("hello", fields)


def test_a_hello_passes_once_within_the_clock_skew_and_never_with_a_wrong_secret() -> None:
    check = HelloCheck(SECRET, skew_limit=300)
    check(hello(seconds=1000), now=1000 + 299)  # the agent's clock 299 s behind
    check(hello(seconds=1000, nonce="b" * 32), now=1000 - 299)  # ahead
    with pytest.raises(AuthenticationError, match=r"^its hello was sent before \(a replay\)$"):
        check(hello(seconds=1000), now=1000 + 1)
    with pytest.raises(AuthenticationError, match=r"^wrong secret$"):
        check(hello(secret=b"x" * 64, seconds=1000, nonce="c" * 32), now=1000)
    forged = hello(seconds=1000, nonce="d" * 32)
    moved = Message("hello", {**forged.fields, "time": forged["time"] + 1})  # proof of another time
    with pytest.raises(AuthenticationError, match=r"^wrong secret$"):
        check(moved, now=1000)
    late = "its clock is 301 s behind the controller's (at most 300 s are tolerated: set"
    with pytest.raises(AuthenticationError, match=re.escape(late)):
        check(hello(seconds=1000, nonce="e" * 32), now=1000 + 301)
    with pytest.raises(AuthenticationError, match="its clock is 400 s ahead of the controller's"):
        check(hello(seconds=1000, nonce="f" * 32), now=1000 - 400)


def test_a_replayed_hello_is_refused_until_it_could_no_longer_pass_as_fresh() -> None:
    check = HelloCheck(SECRET, skew_limit=300)
    check(hello(seconds=1000), now=1000)
    with pytest.raises(AuthenticationError, match="a replay"):
        check(hello(seconds=1000), now=1000 + 300)  # still fresh: remembered
    with pytest.raises(AuthenticationError, match="its clock is 301 s behind"):
        check(hello(seconds=1000), now=1000 + 301)  # no longer fresh, whether remembered or not


class ControllerClockAhead(HelloCheck):
    """The controller's clock 400 s ahead of the agent's."""

    def __call__(self, hello: Message, now: float | None = None) -> None:
        super().__call__(hello, time.time() + 400)


def test_an_agent_whose_clock_is_too_far_off_is_told_by_how_much() -> None:
    controller, agent = tcp_pair()
    results: list[object] = []

    def admit() -> None:
        try:
            admit_agent(controller, SECRET, check=ControllerClockAhead(SECRET))
        except AuthenticationError as error:
            results.append(error)

    thread = threading.Thread(target=admit)
    thread.start()
    told = "refused this agent: its clock is 400 s behind the controller's (at most 300 s are"
    with pytest.raises(ProtocolError, match=re.escape(told)):
        join_controller(agent, SECRET, facts())
    thread.join()
    assert str(results[0]).startswith("its clock is 400 s behind")


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

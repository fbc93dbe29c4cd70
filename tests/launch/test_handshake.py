"""The handshake that admits an agent: its hello proves the secret in its first frame, fresh and
once, from a clock near the controller's; both proofs; garbage refused cleanly."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable

import pytest

from dtrain.launch.handshake import (
    AuthenticationError,
    HelloCheck,
    admit_agent,
    join_controller,
    prove,
    prove_hello,
)
from dtrain.launch.wire import HELLO_LIMIT, PROTOCOL_VERSION, Message, ProtocolError
from tests.launch.peers import SECRET, facts, raw_frame, read_frame, tcp_pair

pytestmark = pytest.mark.timeout(30)


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

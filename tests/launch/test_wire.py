"""Messages and the handshake that admits an agent: framing, limits, secrets, both proofs."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from dtrain.errors import ConfigError
from dtrain.launch.wire import (
    HANDSHAKE_LIMIT,
    AuthenticationError,
    Connection,
    ConnectionClosed,
    ProtocolError,
    admit_agent,
    join_controller,
    prove,
    read_secret,
)

SECRET = b"s" * 64


def pair() -> tuple[Connection, Connection]:
    left, right = socket.socketpair()
    return Connection(left), Connection(right)


def test_messages_keep_fields_and_payload_in_order() -> None:
    sender, receiver = pair()
    sender.send("output", rank=3, lines=["a", "ü"])
    sender.send("chunk", b"\x00" * 100_000, stream="model")
    first, second = receiver.receive(), receiver.receive()
    assert (first.kind, first["rank"], first["lines"], first.payload) == (
        "output",
        3,
        ["a", "ü"],
        b"",
    )
    assert (second.kind, second["stream"], len(second.payload)) == ("chunk", "model", 100_000)


def test_a_closed_peer_and_garbage_are_told_apart() -> None:
    sender, receiver = pair()
    sender.sock.sendall(b"\x00\x00\x00\x03\x00\x00\x00\x00[1]")
    with pytest.raises(ProtocolError, match="without a kind"):
        receiver.receive()
    sender.close()
    with pytest.raises(ConnectionClosed):
        receiver.receive()


def test_an_oversized_frame_is_refused_before_it_is_read() -> None:
    sender, receiver = pair()
    sender.sock.sendall((HANDSHAKE_LIMIT + 1).to_bytes(4, "big") + b"\x00" * 4)
    with pytest.raises(ProtocolError, match="over"):
        receiver.receive(limit=HANDSHAKE_LIMIT)


def handshake(agent_secret: bytes, controller_secret: bytes) -> tuple[object, object]:
    controller, agent = pair()
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
        join_controller(agent, agent_secret, address="127.0.0.1")
        results["agent"] = "joined"
    except Exception as error:
        results["agent"] = error
    thread.join()
    return results["controller"], results["agent"]


def test_both_sides_prove_the_secret() -> None:
    hello, joined = handshake(SECRET, SECRET)
    assert joined == "joined" and hello["address"] == "127.0.0.1"


def test_an_agent_without_the_secret_is_refused() -> None:
    refused, told = handshake(b"x" * 64, SECRET)
    assert isinstance(refused, AuthenticationError) and "wrong secret" in str(refused)
    assert isinstance(told, AuthenticationError)


def test_an_impostor_controller_is_found_out() -> None:
    controller, agent = pair()

    def impostor() -> None:
        controller.send("challenge", nonce="n" * 32, version=1)
        controller.receive()
        controller.send("welcome", proof=prove(b"guess" * 8, "controller", "whatever"))

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(AuthenticationError, match="could not prove"):
        join_controller(agent, SECRET)
    thread.join()


def test_a_secret_file_is_created_private_and_a_readable_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "secret"
    created = read_secret(str(path), create=True)
    assert len(created) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret(str(path)) == created
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_secret(str(path))
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 16"):
        read_secret(str(short))
    with pytest.raises(ConfigError, match="readable file"):
        read_secret(str(tmp_path / "missing"))

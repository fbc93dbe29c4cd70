"""The handshake that admits an agent: each side proves the job's secret, and both derive the keys
that seal every frame after it.

The agent proves the secret in the first frame it sends, at once on connecting: an HMAC over the
time and a random nonce (:func:`prove_hello`). So the controller can tell a stranger from an agent
by the first few hundred bytes a connection sends, within a fraction of a second, and drop anything
else at once (:mod:`door`); a hello is fresh only within :data:`CLOCK_SKEW_LIMIT` of the
controller's clock and only once (:class:`HelloCheck`), so one seen on the path cannot be replayed.
The controller, which sent its nonce on accepting, proves the secret back with an HMAC over its
role and both sides' nonces, and the agent tells its facts only to a controller that did. The
session's two keys come from the secret and both nonces (HKDF-SHA256).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import threading
import time
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dtrain.errors import DtrainError
from dtrain.launch.wire import (
    HANDSHAKE_LIMIT,
    HELLO_LIMIT,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Connection,
    ConnectionClosed,
    Message,
)

HELLO_TIMEOUT = 0.5
"""How long a new connection may take to send its first frame: an agent sends it at once."""
HANDSHAKE_TIMEOUT = 10.0
"""The whole handshake's deadline, however slowly a peer trickles its bytes."""
CLOCK_SKEW_LIMIT = 300.0
"""How far an agent's clock may be from the controller's: a hello is fresh for this long."""


class AuthenticationError(DtrainError):
    """The peer could not prove the job's secret."""


def prove(secret: bytes, role: str, controller_nonce: str, agent_nonce: str) -> str:
    """The controller's proof that it holds the secret, in the handshake of these two nonces."""
    text = f"dtrain/{PROTOCOL_VERSION}/{role}/{controller_nonce}/{agent_nonce}"
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def prove_hello(secret: bytes, milliseconds: int, nonce: str) -> str:
    """The agent's proof that it holds the secret, sent at ``milliseconds`` since the epoch."""
    text = f"dtrain/{PROTOCOL_VERSION}/agent/{milliseconds}/{nonce}"
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def session_keys(secret: bytes, controller_nonce: str, agent_nonce: str) -> tuple[bytes, bytes]:
    """The keys of the frames after the handshake: the controller's, then the agent's."""
    keys = HKDF(
        algorithm=hashes.SHA256(),
        length=64,
        salt=bytes.fromhex(controller_nonce + agent_nonce),
        info=f"dtrain/{PROTOCOL_VERSION}/session keys".encode(),
    ).derive(secret)
    return keys[:32], keys[32:]


def _version_mismatch(theirs: int, who: str) -> AuthenticationError:
    return AuthenticationError(
        f"the {who} speaks protocol {theirs}, this dtrain {PROTOCOL_VERSION}: install the same "
        "dtrain version on every machine"
    )


class HelloCheck:
    """Whether a hello proves the job's secret, now, for the first time.

    A hello is fresh while its time is within :data:`CLOCK_SKEW_LIMIT` of this machine's clock,
    and its nonce is remembered that long after: a hello seen on the path and sent again is
    refused, and so is one from a machine whose clock is further off (the error says by how much).
    Only hellos that carry the proof are remembered, so strangers cannot fill the memory.
    """

    def __init__(self, secret: bytes, skew_limit: float = CLOCK_SKEW_LIMIT) -> None:
        self.secret = secret
        self.skew_limit = skew_limit
        self._seen: dict[str, float] = {}  # nonce: when it stops being fresh
        self._lock = threading.Lock()

    def __call__(self, hello: Message, now: float | None = None) -> None:
        """Raise :class:`AuthenticationError`, saying why, unless ``hello`` is admissible."""
        now = time.time() if now is None else now
        if hello["version"] != PROTOCOL_VERSION:
            raise _version_mismatch(hello["version"], "agent")
        expected = prove_hello(self.secret, hello["time"], hello["nonce"])
        if not hmac.compare_digest(hello["proof"], expected):
            raise AuthenticationError("wrong secret")
        skew = hello["time"] / 1000 - now
        if abs(skew) > self.skew_limit:
            way = "ahead of" if skew > 0 else "behind"
            raise AuthenticationError(
                f"its clock is {abs(skew):.0f} s {way} the controller's (at most "
                f"{self.skew_limit:g} s are tolerated: set the machines' clocks, e.g. with NTP)"
            )
        with self._lock:
            self._seen = {nonce: end for nonce, end in self._seen.items() if end > now}
            if hello["nonce"] in self._seen:
                raise AuthenticationError("its hello was sent before (a replay)")
            self._seen[hello["nonce"]] = now + 2 * self.skew_limit


def send_challenge(connection: Connection) -> str:
    """Controller side, on accepting: its version and nonce, without waiting on the peer (an
    agent sends its hello without waiting for it); the nonce."""
    nonce = secrets.token_hex(NONCE_BYTES)
    if not connection.send("challenge", wait=False, nonce=nonce, version=PROTOCOL_VERSION):
        raise ConnectionClosed(f"{connection.peer} has no room for a challenge")
    return nonce


def refuse(connection: Connection, error: AuthenticationError) -> None:
    """Tell a peer that failed :class:`HelloCheck` why (its user reads it; the agent cannot trust
    it), without waiting on it."""
    with contextlib.suppress(ConnectionClosed):
        connection.send("error", wait=False, message=f"the controller refused this agent: {error}")


def welcome_agent(
    connection: Connection,
    secret: bytes,
    hello: Message,
    nonce: str,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> Message:
    """Controller side, once ``hello`` passed :class:`HelloCheck`: prove the secret back; the
    agent's ``facts``."""
    connection.begin_handshake(timeout)
    connection.send("welcome", proof=prove(secret, "controller", nonce, hello["nonce"]))
    to_agent, to_controller = session_keys(secret, nonce, hello["nonce"])
    connection.secure(sending=to_agent, receiving=to_controller)
    facts = connection.expect("facts", limit=HANDSHAKE_LIMIT)
    connection.end_handshake()
    return facts


def admit_agent(
    connection: Connection,
    secret: bytes,
    timeout: float = HANDSHAKE_TIMEOUT,
    check: HelloCheck | None = None,
) -> Message:
    """Controller side, one connection at a time (the controller's door reads first frames
    without blocking: :mod:`door`): the agent's ``facts`` once both proved the secret."""
    connection.begin_handshake(timeout)
    nonce = send_challenge(connection)
    hello = connection.expect("hello", limit=HELLO_LIMIT)
    try:
        (check or HelloCheck(secret))(hello)
    except AuthenticationError as error:
        refuse(connection, error)
        raise
    return welcome_agent(connection, secret, hello, nonce, timeout)


def join_controller(
    connection: Connection,
    secret: bytes,
    facts: dict[str, Any],
    timeout: float = HANDSHAKE_TIMEOUT,
) -> None:
    """Agent side: prove the secret at once, check the controller's proof, then tell it
    ``facts``."""
    connection.begin_handshake(timeout)
    nonce = secrets.token_hex(NONCE_BYTES)
    milliseconds = time.time_ns() // 1_000_000
    proof = prove_hello(secret, milliseconds, nonce)
    connection.send("hello", version=PROTOCOL_VERSION, time=milliseconds, nonce=nonce, proof=proof)
    challenge = connection.expect("challenge", limit=HANDSHAKE_LIMIT)
    if challenge["version"] != PROTOCOL_VERSION:
        raise _version_mismatch(challenge["version"], "controller")
    welcome = connection.expect("welcome", limit=HANDSHAKE_LIMIT)
    expected = prove(secret, "controller", challenge["nonce"], nonce)
    if not hmac.compare_digest(welcome["proof"], expected):
        raise AuthenticationError(f"{connection.peer} could not prove the job's secret")
    to_agent, to_controller = session_keys(secret, challenge["nonce"], nonce)
    connection.secure(sending=to_controller, receiving=to_agent)
    connection.send("facts", **facts)
    connection.end_handshake()

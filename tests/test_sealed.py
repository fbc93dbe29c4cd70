"""Objects between ranks are unpickled only under the job's key, from the peer, for the receiver
and in the order they were sealed; anything else is refused, naming the peer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from dtrain import jobkey
from dtrain.errors import DtrainError
from dtrain.jobkey import KEY_ENV, derive_key
from dtrain.modelparallel.transport.message import FAILED, FORWARD, Message
from dtrain.modelparallel.transport.wire import _TAG_HEADER, Transport
from dtrain.sealed import (
    EVERY_MEMBER,
    LIMIT_ENV,
    TRUST_STORE_ENV,
    ForgedMessageError,
    OversizedMessageError,
    Seals,
    job_key,
)
from tests.modelparallel.harness import run_ranks

KEY = bytes(32)
GROUP, OTHER_GROUP = (cast(dist.ProcessGroup, SimpleNamespace(group_name=n)) for n in "12")


class _Planted:
    """Unpickling this runs code: it creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_a_sealed_object_round_trips() -> None:
    obj = {"plan": [1, 2.5, "x"], "tensor": torch.arange(3)}
    back = Seals(KEY, 1).unseal(Seals(KEY, 0).seal(obj, GROUP, 1), GROUP, 0)
    assert back["plan"] == obj["plan"] and torch.equal(back["tensor"], obj["tensor"])


def test_a_pickle_under_another_key_is_refused_without_running(tmp_path: Path) -> None:
    planted = tmp_path / "ran"
    forged = Seals(b"another key" * 3, 3).seal(_Planted(planted), GROUP, 1)
    with pytest.raises(ForgedMessageError, match="from rank 3 is not sealed with this job's key"):
        Seals(KEY, 1).unseal(forged, GROUP, 3)
    with pytest.raises(ForgedMessageError):
        Seals(KEY, 1).unseal(bytes(40) + b"\x80\x04no seal at all", GROUP, 3)
    assert not planted.exists()
    Seals(KEY, 1).unseal(Seals(KEY, 3).seal(_Planted(planted), GROUP, 1), GROUP, 3)
    assert planted.exists(), "the test's plant works once sealed with the key"


def test_a_replayed_reordered_or_redirected_message_is_refused_naming_the_peer() -> None:
    sender, receiver = Seals(KEY, 0), Seals(KEY, 1)
    first, second = sender.seal("first", GROUP, 1), sender.seal("second", GROUP, 1)
    with pytest.raises(ForgedMessageError, match=r"#1 from rank 0 came where #0 was due"):
        receiver.unseal(second, GROUP, 0)
    assert receiver.unseal(first, GROUP, 0) == "first"
    with pytest.raises(ForgedMessageError, match=r"#0 from rank 0 came where #1 was due"):
        receiver.unseal(first, GROUP, 0)
    assert receiver.unseal(second, GROUP, 0) == "second"

    elsewhere = "from rank {} is not sealed with this job's key for this receiver and group"
    to_rank_1 = sender.seal("third", GROUP, 1)
    with pytest.raises(ForgedMessageError, match=elsewhere.format(0)):
        Seals(KEY, 2).unseal(to_rank_1, GROUP, 0)  # another receiver
    with pytest.raises(ForgedMessageError, match=elsewhere.format(0)):
        Seals(KEY, 1).unseal(to_rank_1, OTHER_GROUP, 0)  # another group
    with pytest.raises(ForgedMessageError, match=elsewhere.format(3)):
        Seals(KEY, 1).unseal(to_rank_1, GROUP, 3)  # passed on by another rank
    to_the_group = sender.seal("fourth", GROUP, EVERY_MEMBER)
    with pytest.raises(ForgedMessageError, match=elsewhere.format(0)):
        Seals(KEY, 1).unseal(to_the_group, GROUP, 0)  # a collective's part as a message
    assert Seals(KEY, 1).unseal(to_the_group, GROUP, 0, EVERY_MEMBER) == "fourth"


def test_each_job_and_attempt_gets_its_own_key() -> None:
    keys = {
        derive_key(secret, job, salt, attempt)
        for secret in (b"a", b"b")
        for job in ("job", "other-job")
        for salt in ("00", "01")
        for attempt in (1, 2)
    }
    assert len(keys) == 16 and all(len(bytes.fromhex(k)) == 32 for k in keys)


def test_a_length_over_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LIMIT_ENV, "1000")
    seals = Seals(KEY, 1)
    seals.check_length(1000, 3)
    with pytest.raises(OversizedMessageError, match=f"rank 3 .* 1001 bytes.*{LIMIT_ENV}"):
        seals.check_length(1001, 3)
    monkeypatch.setenv(LIMIT_ENV, "lots")
    with pytest.raises(DtrainError, match=f"{LIMIT_ENV} must be a number of bytes"):
        Seals(KEY, 1)


def test_the_key_leaves_the_environment_at_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobkey, "_taken", None)
    monkeypatch.setenv(KEY_ENV, "ab" * 32)
    assert job_key() == bytes([0xAB]) * 32
    assert KEY_ENV not in os.environ
    assert job_key() == bytes([0xAB]) * 32, "still this process's key"
    child = [sys.executable, "-c", f"import os; print(os.environ.get({KEY_ENV!r}))"]
    assert subprocess.run(child, capture_output=True, text=True, check=True).stdout == "None\n"


def test_a_key_through_the_store_needs_the_users_trust(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobkey, "_taken", None)
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(TRUST_STORE_ENV, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert len(job_key()) == 32, "a world of one agrees with nobody"
        with monkeypatch.context() as several:
            several.setattr(dist, "get_world_size", lambda: 2)
            with pytest.raises(DtrainError, match=f"{KEY_ENV} is not set.*{TRUST_STORE_ENV}=1"):
                job_key()
            several.setenv(TRUST_STORE_ENV, "1")
            key = job_key()
            assert len(key) == 32 and job_key() == key, "every rank gets the first one's"
    finally:
        dist.destroy_process_group()


def _hostile_streams() -> list[str] | None:
    """Rank 0 sends rank 1 a stream sealed under another key, one announcing more bytes than
    rank 1 accepts, and a replay of a stream rank 1 took; rank 1's transports refuse each."""
    dist.init_process_group("gloo")
    forged, oversized, replayed = (dist.new_group([0, 1]) for _ in range(3))
    rank = dist.get_rank()
    failures: list[str] = []

    def on_messages(messages: list[tuple[Message, list[torch.Tensor]]]) -> None:
        failures.extend(str(message.body) for message, _ in messages if message.kind == FAILED)

    def transport(group: dist.ProcessGroup, key: bytes = KEY) -> Transport:
        return Transport(rank, [0, 1], group, torch.device("cpu"), 30.0, on_messages, key=key)

    if rank == 0:
        transport(forged, bytes([1]) * 32).send(1, Message(FORWARD, 1, body="hello"))
        announced = bytearray((1 << 40).to_bytes(8, "little") * 2)
        lengths = torch.frombuffer(announced, dtype=torch.uint8)
        dist.isend(lengths, 1, group=oversized, tag=_TAG_HEADER).wait()
        sender = transport(replayed)
        sender.send(1, Message(FORWARD, 1, body="once"))
        (stream,) = sender._unfinished[1].buffers
        dist.isend(stream, 1, group=replayed, tag=_TAG_HEADER).wait()
    else:
        for group in (forged, oversized, replayed):
            transport(group)
        deadline = time.monotonic() + 30
        while len(failures) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    dist.barrier()
    dist.destroy_process_group()
    return failures if rank == 1 else None


def test_the_pipeline_refuses_forged_oversized_and_replayed_streams() -> None:
    _, seen = run_ranks(2, _hostile_streams, timeout=60)
    assert seen is not None and len(seen) == 3, seen
    refusals = (
        "a message from rank 0 is not sealed with this job's key",
        f"rank 0 announced a message of {(1 << 41) + 64} bytes, over the 1073741824 this rank",
        "message #0 from rank 0 came where #1 was due",
    )
    for refusal in refusals:
        assert any(refusal in failure for failure in seen), (refusal, seen)

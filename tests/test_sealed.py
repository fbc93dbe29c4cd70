"""Objects between ranks are unpickled only under the job's key; anything else is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtrain.modelparallel.transport import FORWARD, Message, Transport
from dtrain.sealed import ForgedMessageError, derive_key, seal, unseal
from tests.modelparallel.harness import run_ranks

KEY = bytes(32)


class _Planted:
    """Unpickling this runs code: it creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_a_sealed_object_round_trips() -> None:
    obj = {"plan": [1, 2.5, "x"], "tensor": torch.arange(3)}
    back = unseal(seal(obj, KEY), KEY, "rank 1")
    assert back["plan"] == obj["plan"] and torch.equal(back["tensor"], obj["tensor"])


def test_a_pickle_under_another_key_is_refused_without_running(tmp_path: Path) -> None:
    planted = tmp_path / "ran"
    forged = seal(_Planted(planted), b"another key" * 3)
    with pytest.raises(ForgedMessageError, match="from rank 3 is not sealed with this job's key"):
        unseal(forged, KEY, "rank 3")
    with pytest.raises(ForgedMessageError):
        unseal(bytes(32) + b"\x80\x04no seal at all", KEY, "rank 3")
    assert not planted.exists()
    unseal(seal(_Planted(planted), KEY), KEY, "rank 3")
    assert planted.exists(), "the test's plant works once sealed with the key"


def test_each_attempt_of_a_job_gets_its_own_key() -> None:
    keys = {derive_key(secret, attempt) for secret in (b"a", b"b") for attempt in (1, 2)}
    assert len(keys) == 4 and all(len(bytes.fromhex(k)) == 32 for k in keys)


def _forged_header() -> str | None:
    """Rank 0 sends under a key rank 1 does not hold; rank 1's transport must refuse it."""
    dist.init_process_group("gloo")
    control = dist.new_group([0, 1])
    failures: list[Any] = []

    def on_messages(messages: list[tuple[Message, list[torch.Tensor]]]) -> None:
        failures.extend(message.body for message, _ in messages)

    rank = dist.get_rank()
    key = bytes([rank]) * 32
    transport = Transport(rank, [0, 1], control, torch.device("cpu"), 30.0, on_messages, key=key)
    if rank == 0:
        transport.send(1, Message(FORWARD, 1, body="hello"))
    dist.barrier()
    dist.destroy_process_group()
    return str(failures[0]) if failures else None


def test_the_pipeline_refuses_a_header_not_sealed_with_the_job_key() -> None:
    _, seen = run_ranks(2, _forged_header, timeout=60)
    assert seen is not None
    assert "a message from rank 0 is not sealed with this job's key" in seen

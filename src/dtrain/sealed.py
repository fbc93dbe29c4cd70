"""Python objects between a job's ranks, unpickled only when the job's key vouches for them.

Unpickling runs code, and gloo and NCCL authenticate nobody: whoever can reach a job's ports
could otherwise send a rank a pickle of their choosing. Every object one rank sends another
here is pickled and sealed: an HMAC under the job's key over the pickle and over where it
belongs (the process group it travels in, its sender, its receiver, or every member of the
group for a collective, and its place in that stream: a sequence number per ordered pair of
ranks, or per sender in a group's collectives, which every member calls in the same order).
What arrives is unpickled only if its seal checks out for the peer it came from, this receiver
and the next place; anything else (forged, replayed, reordered, redirected from another rank or
group) is refused, naming the peer. (Tensors travel as bytes and are never unpickled.)

A length a peer announces is checked against ``DTRAIN_MAX_MESSAGE_BYTES`` (default 1 GiB)
before anything is allocated for it, when the seal cannot vouch for it first.

The key: ``DTRAIN_JOB_KEY``, which ``dtrain run``'s agents derive for each attempt from the
job's secret, its name and a random salt made when the job was submitted (the secret never
crosses the network). A rank takes it out of its environment on first use, so that processes
the script starts do not inherit it. Launched otherwise (torchrun, mpirun), there is no key;
the ranks agree on a random one through the rendezvous store only with
``DTRAIN_TRUST_RENDEZVOUS_STORE=1``: anyone who can reach the store can read it.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dtrain.environment import switch
from dtrain.errors import DtrainError
from dtrain.jobkey import KEY_ENV, take_key

TRUST_STORE_ENV = "DTRAIN_TRUST_RENDEZVOUS_STORE"
LIMIT_ENV = "DTRAIN_MAX_MESSAGE_BYTES"
DEFAULT_LIMIT = 1 << 30
EVERY_MEMBER = -1
"""The receiver of a collective's messages: every member of its group."""
_STORE_KEY = "dtrain/job-key"
_MAC_BYTES = 32
_SEQUENCE_BYTES = 8
SEAL_BYTES = _MAC_BYTES + _SEQUENCE_BYTES
"""What a seal adds before the pickle: the HMAC, then the message's sequence number."""


class ForgedMessageError(DtrainError):
    """A message's seal does not vouch for it here: not the job's, or not this place's."""


class OversizedMessageError(DtrainError):
    """A peer announced a message longer than this rank accepts."""


def trusts_store() -> bool:
    """Whether the user accepts a key agreed through the rendezvous store (``TRUST_STORE_ENV``,
    a switch: see :mod:`dtrain.environment`)."""
    return switch(TRUST_STORE_ENV, False)


def job_key() -> bytes:
    """This job's key (see the module docstring); without one from the environment, a world
    of several ranks needs the default process group's store and the user's trust in it."""
    key = take_key()
    if key is not None:
        return key
    if dist.get_world_size() == 1:  # no peer to agree with, nothing through the store
        return os.urandom(32)
    if not trusts_store():
        raise DtrainError(
            f"no job key to seal messages between ranks: {KEY_ENV} is not set (dtrain run "
            "sets it). Under another launcher (torchrun, mpirun) the ranks can agree on a "
            "random key through the rendezvous store, which anyone who can reach the store "
            f"can read: set {TRUST_STORE_ENV}=1 to accept that"
        )
    store = dist.distributed_c10d._get_default_store()
    # The first rank to ask sets it; every rank gets that one.
    return bytes.fromhex(store.compare_set(_STORE_KEY, "", os.urandom(32).hex()).decode())


def message_limit() -> int:
    """The most bytes a rank accepts in one message announced by a peer (``LIMIT_ENV``)."""
    text = os.environ.get(LIMIT_ENV)
    if not text:
        return DEFAULT_LIMIT
    try:
        limit = int(text)
    except ValueError:
        limit = 0  # refused below
    if limit <= 0:
        raise DtrainError(f"{LIMIT_ENV} must be a number of bytes > 0, got {text!r}")
    return limit


def pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _mac(
    key: bytes, group: str, sender: int, receiver: int, sequence: int, payload: bytes | memoryview
) -> bytes:
    place = f"{sender}>{receiver}#{sequence}@{len(group)}:{group}".encode()
    mac = hmac.new(key, place, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


class Seals:
    """One rank's seals: the job's key and the next sequence number of every stream it sends
    or receives (its counts live as long as this object, which both ends of a stream create
    alike: per runtime, per transport)."""

    def __init__(self, key: bytes, rank: int) -> None:
        self.key = key
        self.rank = rank
        self.limit = message_limit()
        self._sent: dict[tuple[str, int], Iterator[int]] = {}
        self._received: dict[tuple[str, int, int], int] = {}
        """The sequence number due next from each sender (a refused message takes no place)."""

    def stamp(self, payload: bytes, group: dist.ProcessGroup, receiver: int) -> bytes:
        """The seal of ``payload`` (a pickle) as this rank's next message to global rank
        ``receiver`` (or :data:`EVERY_MEMBER`) in ``group``; it goes right before the payload.
        Messages must leave in the order they are stamped."""
        name = group.group_name
        sequence = next(self._sent.setdefault((name, receiver), itertools.count()))
        mac = _mac(self.key, name, self.rank, receiver, sequence, payload)
        return mac + sequence.to_bytes(_SEQUENCE_BYTES, "little")

    def seal(self, obj: Any, group: dist.ProcessGroup, receiver: int) -> bytes:
        payload = pickled(obj)
        return self.stamp(payload, group, receiver) + payload

    def unseal(
        self, data: bytes, group: dist.ProcessGroup, sender: int, receiver: int | None = None
    ) -> Any:
        """The object in ``data``, if sealed under the job's key as the next message from
        global rank ``sender`` to ``receiver`` (default: this rank) in ``group``."""
        receiver = self.rank if receiver is None else receiver
        view = memoryview(data)
        mac = view[:_MAC_BYTES]
        sequence = int.from_bytes(view[_MAC_BYTES:SEAL_BYTES], "little")
        payload = view[SEAL_BYTES:]
        name = group.group_name
        if len(view) < SEAL_BYTES or not hmac.compare_digest(
            mac, _mac(self.key, name, sender, receiver, sequence, payload)
        ):
            raise ForgedMessageError(
                f"a message from rank {sender} is not sealed with this job's key for this "
                f"receiver and group (forged or redirected): refused, not unpickled"
            )
        stream = (name, sender, receiver)
        expected = self._received.get(stream, 0)
        if sequence != expected:
            raise ForgedMessageError(
                f"message #{sequence} from rank {sender} came where #{expected} was due "
                "(replayed or reordered): refused, not unpickled"
            )
        self._received[stream] = expected + 1
        return pickle.loads(payload)

    def check_length(self, length: int, sender: int) -> None:
        """Refuse a length announced by ``sender`` over the limit, before allocating it."""
        if not 0 <= length <= self.limit:
            raise OversizedMessageError(
                f"rank {sender} announced a message of {length} bytes, over the {self.limit} "
                f"this rank accepts ({LIMIT_ENV}): refused before allocating it"
            )


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def all_gather_objects(obj: Any, group: dist.ProcessGroup, seals: Seals) -> list[Any]:
    """Every member's ``obj``, by rank in ``group`` (a CPU group: gloo), sealed."""
    data = seals.seal(obj, group, EVERY_MEMBER)
    size = torch.tensor([len(data)], dtype=torch.int64)
    members = dist.get_process_group_ranks(group)
    sizes = [torch.zeros_like(size) for _ in members]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(n.item()) for n in sizes]
    for member, length in zip(members, lengths, strict=True):
        seals.check_length(length, member)
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = _as_tensor(data)
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in members]
    dist.all_gather(parts, padded, group=group)
    return [
        seals.unseal(part[:length].numpy().tobytes(), group, member, EVERY_MEMBER)
        for part, member, length in zip(parts, members, lengths, strict=True)
    ]


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup, seals: Seals) -> Any:
    """Global rank ``src``'s ``obj``, on every member of ``group`` (a CPU group: gloo), sealed."""
    data = seals.seal(obj, group, EVERY_MEMBER) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    seals.check_length(int(size.item()), src)
    buffer = _as_tensor(data) if data else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return seals.unseal(buffer.numpy().tobytes(), group, src, EVERY_MEMBER)

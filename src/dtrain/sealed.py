"""Python objects between a job's ranks, unpickled only when the job's key vouches for them.

Unpickling runs code, and gloo and NCCL authenticate nobody: whoever can reach a job's ports
could otherwise send a rank a pickle of their choosing. Every object one rank sends another
here is pickled and sealed with an HMAC under the job's key; what arrives is unpickled only if
its seal checks out, else it fails, naming the peer. (Tensors travel as bytes and are never
unpickled.)

The key: ``DTRAIN_JOB_KEY``, which ``dtrain run``'s agents derive from the job's secret for
each attempt (it never crosses the network). Launched otherwise (torchrun, mpirun), the ranks
agree on a random key through the rendezvous store, which keeps out only those who cannot read
the store.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

from dtrain.errors import DtrainError

KEY_ENV = "DTRAIN_JOB_KEY"
_STORE_KEY = "dtrain/job-key"
_SEAL_BYTES = 32


class ForgedMessageError(DtrainError):
    """A message's seal does not match the job's key: it was not written by the job."""


def derive_key(secret: bytes, attempt: int) -> str:
    """The ranks' key of one attempt of a job, from the job's secret (hex)."""
    return hmac.new(secret, f"dtrain ranks' key, attempt {attempt}".encode(), "sha256").hexdigest()


def job_key() -> bytes:
    """This job's key (see the module docstring); needs the default process group's store
    when the environment has none (a new world agrees on a new key)."""
    if os.environ.get(KEY_ENV):
        return bytes.fromhex(os.environ[KEY_ENV])
    store = dist.distributed_c10d._get_default_store()
    # The first rank to ask sets it; every rank gets that one.
    return bytes.fromhex(store.compare_set(_STORE_KEY, "", os.urandom(32).hex()).decode())


def seal(obj: Any, key: bytes) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return hmac.new(key, payload, hashlib.sha256).digest() + payload


def unseal(data: bytes, key: bytes, peer: str) -> Any:
    """The object in ``data``, if its seal is the job's; ``peer`` names the sender in errors."""
    mac, payload = data[:_SEAL_BYTES], data[_SEAL_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()):
        raise ForgedMessageError(
            f"a message from {peer} is not sealed with this job's key: refused, not unpickled"
        )
    return pickle.loads(payload)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def all_gather_objects(obj: Any, group: dist.ProcessGroup, key: bytes) -> list[Any]:
    """Every member's ``obj``, by rank in ``group`` (a CPU group: gloo), sealed with ``key``."""
    data = seal(obj, key)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = _as_tensor(data)
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [
        unseal(part[: int(n.item())].numpy().tobytes(), key, f"member {index} of the group")
        for index, (part, n) in enumerate(zip(parts, sizes, strict=True))
    ]


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup, key: bytes) -> Any:
    """Global rank ``src``'s ``obj``, on every member of ``group`` (a CPU group: gloo), sealed
    with ``key``."""
    data = seal(obj, key) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buffer = _as_tensor(data) if data else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return unseal(buffer.numpy().tobytes(), key, f"rank {src}")

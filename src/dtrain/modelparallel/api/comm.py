"""Python objects between ranks: SMP v1's ``broadcast``, ``send``, ``recv_from``, ``allgather``.

Objects are pickled, sealed for their receiver (:mod:`dtrain.sealed`) and travel over gloo
groups with the members of the model-parallel groups (``MPState.object_groups``), so they work
whatever backend the world uses. Point-to-point messages, and ``broadcast`` (which SMP defines
as a send to every other member of the group, each receiver calling ``recv_from``), go over the
world's gloo group; a send completes when the receiver takes it. A wait longer than
``options.timeout`` seconds fails naming the peer rank, or the group's ranks for collectives.

A tensor on a GPU (plain or a parameter's data) is unpickled on the receiving rank's device,
not on the sender's GPU index, which on the receiver is another rank's GPU or none at all.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from dtrain.dataparallel.single import started
from dtrain.modelparallel.errors import CommunicationTimeoutError, ModelParallelError
from dtrain.modelparallel.state import MPState, current
from dtrain.sealed import SEAL_BYTES, all_gather_objects, pickled


class CommGroup(IntEnum):
    """The groups a collective can run in (SMP's values)."""

    WORLD = 0
    PP_GROUP = 1
    TP_GROUP = 2
    RDP_GROUP = 3
    DP_GROUP = 4
    MP_GROUP = 5


class RankType(IntEnum):
    """Which group a peer's rank is counted in (SMP's values, matching :class:`CommGroup`)."""

    WORLD_RANK = 0
    PP_RANK = 1
    TP_RANK = 2
    RDP_RANK = 3
    DP_RANK = 4
    MP_RANK = 5


WORLD = CommGroup.WORLD
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
DP_GROUP = CommGroup.DP_GROUP
MP_GROUP = CommGroup.MP_GROUP

_KINDS = ("world", "pp", "tp", "rdp", "dp", "mp")
"""Group kind by enum value (``CommGroup`` and ``RankType`` share the numbering)."""

_TAG = 0x534D50
"""Tag of object messages, so they never match the runtime's own point-to-point traffic."""

_TIMEOUT = re.compile(r"timed? ?out", re.IGNORECASE)


def _kind(value: int) -> str:
    return _KINDS[CommGroup(value)]


def _members(st: MPState, kind: str) -> list[int]:
    return list(range(st.size)) if kind == "world" else list(getattr(st, f"{kind}_group"))


def _global_rank(st: MPState, group_rank: int, rank_type: RankType) -> int:
    members = _members(st, _kind(rank_type))
    if not 0 <= group_rank < len(members):
        raise ValueError(
            f"{RankType(rank_type).name} {group_rank} does not exist: allowed 0 to "
            f"{len(members) - 1}"
        )
    return members[group_rank]


@contextmanager
def _waiting(st: MPState, action: str) -> Iterator[None]:
    """Turn gloo's errors into ours, saying which rank did what and for how long it waited."""
    try:
        yield
    except RuntimeError as exc:  # gloo reports timeouts and lost peers as RuntimeError
        if _TIMEOUT.search(str(exc)):
            raise CommunicationTimeoutError(
                f"rank {st.rank}: {action}: no answer within {st.options.timeout:g} s ({exc})"
            ) from exc
        raise ModelParallelError(f"rank {st.rank}: {action} failed: {exc}") from exc


class _Portable:
    """An object to send, pickled with its GPU tensors as host copies that unpickle on the
    receiver's device (:func:`_on_this_rank`)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self) -> tuple[Any, ...]:
        buffer = io.BytesIO()
        _HostPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(self.obj)
        return pickle.loads, (buffer.getvalue(),)


class _HostPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.is_cuda:  # a Parameter pickles its data as one
            return _on_this_rank, (obj.detach().cpu(), obj.requires_grad)
        return NotImplemented


def _on_this_rank(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A tensor that was on the sender's GPU, on this rank's device."""
    return tensor.to(current().device).requires_grad_(requires_grad)


def _send_to(st: MPState, obj: Any, peers: list[int]) -> None:
    """Send ``obj`` to every rank of ``peers`` at once, sealed for each; returns when all
    have taken it."""
    group = st.object_groups["world"]
    payload = pickled(_Portable(obj))
    stamped = [bytearray(st.seals.stamp(payload, group, peer) + payload) for peer in peers]
    sealed = [torch.frombuffer(data, dtype=torch.uint8) for data in stamped]
    size = torch.tensor([SEAL_BYTES + len(payload)], dtype=torch.int64)
    for parts in ([size] * len(peers), sealed):  # all sizes before any data: parts stay in order
        works = [
            started(dist.isend(part, peer, group=group, tag=_TAG))
            for part, peer in zip(parts, peers, strict=True)
        ]
        for work in works:
            work.wait()


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send a picklable object to rank ``dest_rank`` of ``rank_type``'s group; it must call
    ``recv_from`` (blocks until it does)."""
    st = current("smp.send")
    peer = _global_rank(st, dest_rank, rank_type)
    if peer == st.rank:
        raise ValueError(f"smp.send: rank {st.rank} cannot send to itself")
    with _waiting(st, f"send to rank {peer} ({RankType(rank_type).name} {dest_rank})"):
        _send_to(st, obj, [peer])


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """The next object rank ``src_rank`` of ``rank_type``'s group sent here (send/broadcast)."""
    st = current("smp.recv_from")
    peer = _global_rank(st, src_rank, rank_type)
    if peer == st.rank:
        raise ValueError(f"smp.recv_from: rank {st.rank} cannot receive from itself")
    group = st.object_groups["world"]
    with _waiting(st, f"recv_from rank {peer} ({RankType(rank_type).name} {src_rank})"):
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, peer, group=group, tag=_TAG)
        st.seals.check_length(int(size.item()), peer)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, peer, group=group, tag=_TAG)
    return st.seals.unseal(data.numpy().tobytes(), group, peer)


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send ``obj`` to every other member of ``group``; each calls ``recv_from(src, rank type)``."""
    st = current("smp.broadcast")
    kind = _kind(group)
    members = _members(st, kind)
    if st.rank not in members:
        raise ValueError(f"smp.broadcast: rank {st.rank} is not in the {kind} group {members}")
    peers = [m for m in members if m != st.rank]
    with _waiting(st, f"broadcast over the {kind} group to ranks {peers}"):
        _send_to(st, obj, peers)


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """Every member's ``obj``, indexed by rank in ``group``; every member must call it."""
    st = current("smp.allgather")
    kind = _kind(group)
    members = _members(st, kind)
    with _waiting(st, f"allgather over the {kind} group (ranks {members})"):
        gathered = all_gather_objects(_Portable(obj), st.object_groups[kind], st.seals)
    return gathered


def gather(obj: Any, group: CommGroup, rank: int = 0) -> list[Any] | None:
    """Every member's ``obj`` on rank ``rank`` of ``group`` (a list there, None elsewhere)."""
    st = current("smp.gather")
    kind = _kind(group)
    members = _members(st, kind)
    dst = _global_rank(st, rank, RankType(CommGroup(group)))
    with _waiting(st, f"gather to rank {dst} over the {kind} group (ranks {members})"):
        gathered = all_gather_objects(_Portable(obj), st.object_groups[kind], st.seals)
    return gathered if st.rank == dst else None


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait until every member of ``group`` arrives; a timeout names the ranks that did not."""
    st = current("smp.barrier")
    kind = _kind(group)
    members = _members(st, kind)
    numbered = f"global ranks {members}, numbered 0-{len(members) - 1} below"
    with _waiting(st, f"barrier of the {kind} group ({numbered})"):
        dist.monitored_barrier(
            group=st.object_groups[kind],
            timeout=timedelta(seconds=st.options.timeout),
            wait_all_ranks=True,
        )


def mp_barrier() -> None:
    barrier(CommGroup.MP_GROUP)


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def tp_barrier() -> None:
    barrier(CommGroup.TP_GROUP)


def rdp_barrier() -> None:
    barrier(CommGroup.RDP_GROUP)

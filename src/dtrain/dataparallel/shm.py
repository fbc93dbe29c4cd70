"""All-reduce through shared memory inside a host, for CPU gradients (opt-in).

gloo moves a bucket between two processes on one host over loopback TCP: every byte is copied
into the kernel and out again by gloo's threads, on the cores backward is using (15-20 ms of a
260 ms step for the 15 MB of docs/benchmarks.md's loopback scenario on 2 cores). Here each
rank's bucket buffer is its own slot of a segment in ``/dev/shm`` that every rank of the host
maps, and each chunk of a bucket, L slots cut into L shards, is reduced in three stages:

1. arrive: a barrier says every slot holds its rank's pre-divided gradients.
2. reduce: local rank i adds shard i of every other slot into shard i of its own (it reads
   (L-1)/L of a bucket, writes 1/L). With several hosts it then all-reduces that shard with the
   ranks of the same local rank on the other hosts, the only bytes that leave the host, in the
   codec's wire format. A barrier says every shard is final.
3. gather: each rank copies the other shards from their owners' slots into its own; a barrier
   says no slot is read any more, so the next backward may write into them.

Only barriers use the loopback. Each shard is summed by one rank and copied by the rest, so all
ranks hold bit-identical averages. Barriers of different stages go to different groups: the
reducer issues each stage in chunk order, but two stages can interleave differently per rank.

Segments are unlinked as soon as every rank has mapped them (nothing is left in ``/dev/shm``
when processes die) and reserved with ``posix_fallocate`` (a full ``/dev/shm`` is an error at
allocation, not a SIGBUS in backward).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dtrain.dataparallel.compression import Codec
from dtrain.dataparallel.strategies import BufferSpec, Transfer, own_group
from dtrain.environment import switch
from dtrain.sealed import Seals, broadcast_object, job_key

SHM_ENV = "DTRAIN_SHM_ALLREDUCE"
"""A switch (:mod:`dtrain.environment`) that reduces through shared memory when the constructor
leaves ``shared_memory`` None."""

SHM_DIR = "/dev/shm"


class SharedMemoryUnavailable(RuntimeError):
    """The host's ranks cannot share memory here; the message says why."""


def wants_shared_memory(requested: bool | None) -> bool:
    """Resolve ``shared_memory=None|True|False``: None reads the env var (unset: off)."""
    if requested is None:
        return switch(SHM_ENV, False)
    return requested


@dataclass
class SharedMemoryAllReduce:
    """Reduce-scatter and all-gather through ``/dev/shm`` in the host; all-reduce across hosts.

    ``cross_host`` is None on a single host. ``codec`` is applied to the cross-host shard only:
    inside the host bytes only cross memory, where 16 bits would save little and cost two casts.
    """

    host_rank: int
    host_size: int
    signals: tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]
    cross_host: dist.ProcessGroup | None
    codec: Codec
    seals: Seals = field(repr=False)
    _segments: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)
    _chunks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._stages: list[Callable[[torch.Tensor, Transfer], dist.Work]] = [
            self._arrive,
            self._reduce,
            self._cross_host_done,
            self._gather,
        ]
        if self.cross_host is None:
            self._stages.remove(self._cross_host_done)

    @classmethod
    def create(
        cls, rank: int, hosts: list[list[int]], columns: list[list[int]], codec: Codec
    ) -> SharedMemoryAllReduce:
        """Create the groups and check that each host's ranks really share ``/dev/shm``.

        ``hosts`` and ``columns`` partition the world (every rank must call this, a collective).
        Raises ``SharedMemoryUnavailable`` on every rank if the check fails on any.
        """
        signals = (
            own_group(rank, hosts, "gloo"),
            own_group(rank, hosts, "gloo"),
            own_group(rank, hosts, "gloo"),
        )
        cross_host = own_group(rank, columns, "gloo") if len(columns[0]) > 1 else None
        host = next(ranks for ranks in hosts if rank in ranks)
        seals = Seals(job_key(), rank)
        strategy = cls(host.index(rank), len(host), signals, cross_host, codec, seals)
        error = strategy._probe()
        if not strategy._everywhere(error is None):
            raise SharedMemoryUnavailable(error or "a rank on another host cannot share memory")
        return strategy

    @property
    def num_stages(self) -> int:
        return 3 if self.cross_host is None else 4

    @property
    def pad_multiple(self) -> int:
        return self.host_size

    def buffers(self, specs: Sequence[BufferSpec]) -> list[torch.Tensor]:
        """This rank's slots of new segments, one per bucket; the previous plan's are released."""
        self._segments.clear()
        self._chunks.clear()
        segments = self._map([spec.numel * spec.dtype.itemsize * self.host_size for spec in specs])
        for segment, spec in zip(segments, specs, strict=True):
            slots = torch.frombuffer(segment, dtype=spec.dtype, count=spec.numel * self.host_size)
            slots = slots.view(self.host_size, spec.numel)
            self._segments.append((slots[self.host_rank], slots))
        return [own for own, _ in self._segments]

    def launch(self, stage: int, transfer: Transfer) -> dist.Work:
        key = (transfer.wire.data_ptr(), transfer.wire.numel())
        if key not in self._chunks:
            self._chunks[key] = self._shards(transfer.wire)
        return self._stages[stage](self._chunks[key], transfer)

    def _shards(self, wire: torch.Tensor) -> torch.Tensor:
        """``wire`` (part of this rank's slot) on every slot: [slot, shard, element]."""
        for own, slots in self._segments:
            offset = (wire.data_ptr() - own.data_ptr()) // own.element_size()
            if 0 <= offset < own.numel():
                span = slots[:, offset : offset + wire.numel()]
                return span.view(self.host_size, self.host_size, -1)
        raise ValueError("the wire is not in a shared-memory slot of this strategy")

    # --- stages --------------------------------------------------------------------------------

    def _arrive(self, shards: torch.Tensor, transfer: Transfer) -> dist.Work:
        return self._signal(0)

    def _reduce(self, shards: torch.Tensor, transfer: Transfer) -> dist.Work:
        own = shards[self.host_rank, self.host_rank]
        for other in range(self.host_size):
            if other != self.host_rank:
                own.add_(shards[other, self.host_rank])
        if self.cross_host is None:
            return self._signal(1)
        transfer.scratch = self.codec.to_wire(own)
        return dist.all_reduce(transfer.scratch, group=self.cross_host, async_op=True)

    def _cross_host_done(self, shards: torch.Tensor, transfer: Transfer) -> dist.Work:
        assert transfer.scratch is not None, "the reduce stage sets the wire shard"
        self.codec.decode(transfer.scratch, shards[self.host_rank, self.host_rank])
        return self._signal(1)

    def _gather(self, shards: torch.Tensor, transfer: Transfer) -> dist.Work:
        for other in range(self.host_size):
            if other != self.host_rank:
                shards[self.host_rank, other].copy_(shards[other, other])
        return self._signal(2)

    def _signal(self, stage: int) -> dist.Work:
        return dist.barrier(group=self.signals[stage], async_op=True)

    # --- segments ------------------------------------------------------------------------------

    def _probe(self) -> str | None:
        """Why the host leader's token, written to ``/dev/shm``, does not reach this rank."""
        token = secrets.token_hex(8)
        try:
            (segment,) = self._map([len(token)])
        except (OSError, RuntimeError) as error:
            return f"shared memory between the ranks of a host: {error}"
        if self.host_rank == 0:
            segment[:] = token.encode()
        shared = broadcast_object(token, self._leader(), self.signals[0], self.seals)
        if bytes(segment[:]).decode(errors="replace") != shared:
            return f"ranks given as one host do not see the same {SHM_DIR}"
        return None

    def _map(self, sizes: list[int]) -> list[mmap.mmap]:
        """Map a new shared file of each size on every host rank (a collective of the host)."""
        created = _create(sizes) if self.host_rank == 0 else None
        listing = broadcast_object(created, self._leader(), self.signals[0], self.seals)
        if listing is None or listing.startswith("error:"):
            raise RuntimeError(listing or "the host leader could not create segments")
        paths = listing.split("\n")
        segments: list[mmap.mmap] = []
        try:
            for path, size in zip(paths, sizes, strict=True):
                segments.append(_open(path, size))
            mapped = True
        except OSError:
            mapped = False
        ok = self._agree(mapped)
        if self.host_rank == 0:
            for path in paths:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if not ok:
            raise RuntimeError(f"a rank of this host could not map {SHM_DIR} segments")
        return segments

    def _agree(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank of the host."""
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.signals[0])
        return bool(flag.item())

    def _everywhere(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank of every host."""
        flag = torch.tensor([int(self._agree(ok))])
        if self.cross_host is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.cross_host)
        return bool(flag.item())

    def _leader(self) -> int:
        return dist.get_global_rank(self.signals[0], 0)


def _create(sizes: list[int]) -> str:
    """Create and reserve one file per size; their paths, one per line, or ``error: ...``."""
    reserve = getattr(os, "posix_fallocate", lambda fd, _, size: os.ftruncate(fd, size))
    paths: list[str] = []
    try:
        for size in sizes:
            path = os.path.join(SHM_DIR, f"dtrain-{os.getpid()}-{secrets.token_hex(8)}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            paths.append(path)
            try:
                reserve(fd, 0, max(size, 1))
            finally:
                os.close(fd)
    except OSError as error:
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return f"error: cannot reserve {sum(sizes)} bytes in {SHM_DIR}: {error}"
    return "\n".join(paths)


def _open(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, max(size, 1))
    finally:
        os.close(fd)

"""Messages between the ranks of one pipeline group: a pickled header and its tensors' bytes.

What travels is one byte stream: two lengths, the pickled headers of one or more messages (kind,
call id, module name, a Python structure whose tensors are replaced by :class:`TensorRef`
placeholders, the tensors' shapes, dtypes and device kinds), sealed as the next stream from
the sender to the receiver (:mod:`dtrain.sealed`), then every tensor's bytes, each 64-byte
aligned. The receiver checks the seal before it allocates anything for the tensors, whose
length the headers must describe.
Several messages to one peer can go as one stream (:meth:`Transport.send_all`); the receiver
handles them in order. A tensor that needs no gradient and is passed more than once in a stream
(a mask or a buffer given to several remote modules) travels once, and the receiver gets one
tensor for all its uses, as the sender had.

One receiver thread per peer keeps a receive from that peer posted over a gloo group, into a
buffer of ``FIRST_SEND_BYTES``; gloo accepts a send shorter than the receive, so a message up to
that size is one send whatever its length. A longer one sends the rest in one more. A receive
that names its source lets gloo tell the sender in advance, whose send then writes the bytes at
once; a receive from any source made every message wait for a round trip between the two
ranks' gloo threads first (measured: the first message of a step reached the last stage
0.3–4.5 ms after it was sent, then 0.02–0.2 ms). Messages from one peer are handled in order;
messages from different peers are not ordered with each other. Few sends matter: gloo does not
start a send before the receiver has posted its receive, so a second part costs a round trip
through the receiver thread, which has to wait for the GIL first.

There is one data plane, host memory over gloo, also between ranks that compute on GPUs: the
sender copies a CUDA tensor's bytes into the stream (device to host), the receiver rebuilds it
on its own GPU (:func:`rebuilt_device`); a CPU tensor stays on the CPU. NCCL point-to-point
would save that copy but cannot serve this transport: it puts both directions between two ranks
on one communicator and stream, where opposite sends that are not batched deadlock above its
buffer size, and it forbids using a communicator from two threads, while here any task thread
sends and a thread per peer receives. gloo has neither rule (every receive is posted by its own
thread, whatever the other threads send), and ranks that share one GPU (a gloo world) pipeline
as ranks on several GPUs do.

Those copies go through pinned host memory, on copy streams (:mod:`dtrain.streams`): the
sender's after the compute stream's work so far (its tensors' producers), with the compute
queued after the send waiting for them on the GPU (it may write the tensors in place), each
receiver's beside the compute, so that it neither waits for the compute queued meanwhile nor
holds it up. A stream holding GPU bytes is pinned memory from torch's caching host allocator,
which hands it out again to a later stream of its size; a receiver's buffer for first sends is
pinned once, on a GPU rank. gloo reads and writes the host memory itself, so a stream leaves
only once its copies are done: the sender does not wait for them, a thread of the transport's
own does and posts it, in the order the streams were sent (:mod:`.posting`); the receiver's CPU
waits for its copies before it reuses its buffer. A received tensor, made on the copy stream, is
recorded on the stream that computes with it: the runtime's threads all compute on their
device's default stream.

Streams are posted one at a time, which keeps one message's parts together; the receiver reads
a whole message before the next, so parts never interleave. A stream's sends are waited for
(and its buffers kept) until the next stream to the same peer is sent, or the transport closes:
the receiver reposts its receive as soon as it has read a stream, so that wait rarely blocks,
and no extra thread has to wake up to finish a send.

Requests are matched to replies by call id through :class:`Pending` futures. Every wait has a
timeout whose error names the peer and the request. ``close`` sends a stop message to every peer
and joins each receiver once it has its peer's stop.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dtrain.dataparallel.single import started
from dtrain.modelparallel.errors import (
    CommunicationTimeoutError,
    ModelParallelError,
)
from dtrain.modelparallel.timeline import TimelineRecorder
from dtrain.modelparallel.transport.message import (
    ERROR,
    FAILED,
    REPLY,
    STOP,
    Message,
    Pending,
    TensorMeta,
    error_body,
    rebuilt_device,
)
from dtrain.modelparallel.transport.posting import Poster
from dtrain.sealed import SEAL_BYTES, ForgedMessageError, Seals, job_key, pickled
from dtrain.streams import SideStream

FIRST_SEND_BYTES = 8 << 20
"""Most bytes of a message's first send (the receiver's buffer); longer messages send the rest
in one more."""

_LENGTH_BYTES = 8
_ALIGN = 64
_TAG_HEADER, _TAG_OVERFLOW = 1, 2


@dataclass(frozen=True)
class _Outgoing:
    """A stream ready to leave once its bytes are in host memory."""

    dst: int
    messages: list[Message]
    payload: bytes
    stream: torch.Tensor
    parts: list[tuple[torch.Tensor, int]]
    sources: list[torch.Tensor]
    """The GPU tensors its copies read: kept until the copies are done, so that their memory
    is not handed out again before."""


@dataclass(frozen=True)
class _Sent:
    """A stream on its way: its sends, and the buffers they read until they complete."""

    dst: int
    message: Message
    """The stream's first message (named in errors)."""
    works: list[dist.Work]
    buffers: list[torch.Tensor]


class Transport:
    """Messaging of one rank with the other ranks of its pipeline group."""

    def __init__(
        self,
        rank: int,
        peers: list[int],
        message_group: dist.ProcessGroup,
        device: torch.device,
        timeout: float,
        on_messages: Callable[[list[tuple[Message, list[torch.Tensor]]]], None],
        first_send_bytes: int = FIRST_SEND_BYTES,
        key: bytes | None = None,
        recorder: TimelineRecorder | None = None,
    ) -> None:
        """``message_group`` is a gloo group of the pipeline; ``device`` is where this rank
        computes (received GPU tensors land there); ``key`` seals the headers
        (:mod:`dtrain.sealed`; default: the job's), each stream as the next from this rank to
        its peer, so that a stream replayed, reordered or sent elsewhere is refused;
        ``recorder`` gets every stream sent and received as a ``SEND`` or ``RECV`` event."""
        self.rank = rank
        self._recorder = recorder
        self.peers = [p for p in peers if p != rank]
        self.timeout = timeout
        self.last_activity = time.monotonic()
        self._group, self._device = message_group, device
        self._on_messages = on_messages
        """Gets the messages of a stream that are not replies, together, in order."""
        self._first_bytes = first_send_bytes
        self._seals = Seals(job_key() if key is None else key, rank)
        self._posting: Poster[_Outgoing] = Poster(self._post, self.fail, f"dtrain-mp-poster-{rank}")
        self._send_copies = SideStream(device)
        self._unfinished: dict[int, _Sent] = {}
        """The last stream sent to each peer, until its sends are known to be complete."""
        self._pending: dict[int, Pending] = {}
        self._pending_lock = threading.Lock()
        self._ids: Iterator[int] = itertools.count(1)
        self._failure: BaseException | None = None
        self._threads = [
            threading.Thread(
                target=self._receive_loop,
                args=(peer,),
                name=f"dtrain-mp-receiver-{rank}-from-{peer}",
                daemon=True,
            )
            for peer in self.peers
        ]
        for thread in self._threads:
            thread.start()

    # --- sending -----------------------------------------------------------------------------

    def next_call_id(self) -> int:
        return next(self._ids)

    def send(self, dst: int, message: Message, tensors: list[torch.Tensor] | None = None) -> None:
        """Send a header and its tensors to global rank ``dst``; raises if the transport failed."""
        self.send_all(dst, [(message, tensors or [])])

    def send_all(self, dst: int, items: list[tuple[Message, list[torch.Tensor]]]) -> None:
        """Send messages (each with its tensors) to ``dst`` as one stream, in this order."""
        if self._failure is not None:
            raise ModelParallelError(f"rank {self.rank}: transport failed: {self._failure}")
        self._send_now(dst, items)

    def _send_now(self, dst: int, items: list[tuple[Message, list[torch.Tensor]]]) -> None:
        started = self._recorder.now() if self._recorder is not None else 0.0
        messages = [message for message, _ in items]
        distinct: list[tuple[torch.Tensor, TensorMeta]] = []
        slots: dict[int, int] = {}  # id of a tensor without gradient → its slot
        for message, sent in items:
            message.source = self.rank
            metas = []
            for tensor in sent:
                grad = tensor.requires_grad and tensor.is_floating_point()
                slot = -1 if grad else slots.get(id(tensor), -1)
                meta = TensorMeta(
                    tuple(tensor.shape), tensor.dtype, grad, len(distinct), tensor.is_cuda
                )
                if slot < 0:
                    distinct.append((tensor, meta))
                    if not grad:
                        slots[id(tensor)] = meta.slot
                else:
                    meta = distinct[slot][1]
                metas.append(meta)
            message.meta = tuple(metas)
        payload = pickled(messages)
        length = SEAL_BYTES + len(payload)
        start = _aligned(2 * _LENGTH_BYTES + length)
        offsets, data_bytes = _layout([meta for _, meta in distinct])
        end = start + data_bytes
        from_gpu = any(tensor.is_cuda and tensor.numel() for tensor, _ in distinct)
        stream = torch.empty(end, dtype=torch.uint8, pin_memory=from_gpu)
        stream[: 2 * _LENGTH_BYTES] = torch.frombuffer(
            bytearray(length.to_bytes(_LENGTH_BYTES, "little"))
            + bytearray(data_bytes.to_bytes(_LENGTH_BYTES, "little")),
            dtype=torch.uint8,
        )
        stream[2 * _LENGTH_BYTES + SEAL_BYTES : 2 * _LENGTH_BYTES + length] = torch.frombuffer(
            bytearray(payload), dtype=torch.uint8
        )
        data = stream[start:]
        if from_gpu:  # copied on the copy stream, after the tensors' producers
            self._send_copies.wait_for_current()
        with self._send_copies.entered():
            for (tensor, meta), offset in zip(distinct, offsets, strict=True):
                if tensor.numel():
                    part = data[offset : offset + _nbytes(meta)]
                    part.copy_(_as_bytes(tensor), non_blocking=True)
        if from_gpu:  # compute queued later (it may write the tensors in place) waits for them
            self._send_copies.join()
        parts = [(stream[: min(end, self._first_bytes)], _TAG_HEADER)]
        if end > self._first_bytes:
            parts.append((stream[self._first_bytes : end], _TAG_OVERFLOW))
        sources = [tensor for tensor, _ in distinct if tensor.is_cuda] if from_gpu else []
        outgoing = _Outgoing(dst, messages, payload, stream, parts, sources)
        # gloo reads the bytes once the copies are done: the poster waits for them, not we.
        self._posting.submit(outgoing, self._send_copies.recorded() if from_gpu else None)
        self._record("SEND", messages, started, dst, end, "to")

    def _post(self, outgoing: _Outgoing) -> None:
        """Seal a stream as the next to its peer and start its sends, once the previous
        stream's sends are done (under the poster's lock: in the order the streams leave)."""
        dst, stream = outgoing.dst, outgoing.stream
        previous = self._unfinished.pop(dst, None)
        if previous is not None:
            self._finish(previous)
        seal = self._seals.stamp(outgoing.payload, self._group, dst)
        stream[2 * _LENGTH_BYTES : 2 * _LENGTH_BYTES + SEAL_BYTES] = torch.frombuffer(
            bytearray(seal), dtype=torch.uint8
        )
        works = [
            started(dist.isend(part, dst=dst, group=self._group, tag=tag))
            for part, tag in outgoing.parts
        ]
        buffers = [part for part, _ in outgoing.parts]
        self._unfinished[dst] = _Sent(dst, outgoing.messages[0], works, buffers)

    def _finish(self, sent: _Sent) -> None:
        """Wait for a stream's sends; a failed or overdue one fails the transport (and raises)."""
        what = f"{sent.message.describe()} to rank {sent.dst}"
        for work in sent.works:
            try:
                finished = work.wait(timedelta(seconds=self.timeout))
            except RuntimeError as exc:
                error: BaseException = ModelParallelError(f"sending {what} failed: {exc}")
            else:
                if finished is not False:
                    continue
                error = CommunicationTimeoutError(
                    f"sending {what}: not taken within {self.timeout:g} s"
                )
            self.fail(error)
            raise error

    def expect(self, dst: int, request: Message) -> Pending:
        """The future reply to ``request`` (sent to ``dst`` now or later): its reply, matched by
        ``request.call_id``, resolves it."""
        pending = Pending(dst, request)
        with self._pending_lock:
            self._pending[request.call_id] = pending
        return pending

    def forget(self, call_id: int) -> None:
        """No reply will be waited for: stop expecting one (a late one is dropped)."""
        with self._pending_lock:
            self._pending.pop(call_id, None)

    # --- receiving ---------------------------------------------------------------------------

    def _receive_loop(self, peer: int) -> None:
        """One peer's messages, until its stop. Every message's first part lands in one buffer
        (its tensors are copied out before the next). On a GPU the thread starts on the rank's
        device, so that tensors made without a device index land there."""
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            copies = SideStream(self._device)
            buffer = torch.empty(self._first_bytes, dtype=torch.uint8, pin_memory=copies.gpu)
            stopped = False
            while not stopped:
                # Handled in a call of its own: nothing of one stream (the inputs of a served
                # call, a reply's gradients) stays referenced while the next receive waits.
                stopped = self._take(self._receive_one(peer, buffer, copies))
        except BaseException as exc:  # the process group broke: fail every waiter
            self.fail(exc, tell_peers=False)

    def _take(self, received: list[tuple[Message, list[torch.Tensor]]]) -> bool:
        """Hand on one stream's messages: replies to their waiters, requests and notices to the
        runtime; whether the peer stopped."""
        stopped = False
        others = []
        for message, tensors in received:
            if message.kind == STOP:
                stopped = True
            elif message.kind == FAILED:  # the peer's pipeline broke: so is ours
                self.fail(message.body, tell_peers=False)
            elif message.kind in (REPLY, ERROR):
                with self._pending_lock:
                    pending = self._pending.pop(message.call_id, None)
                if pending is not None:
                    pending.resolve(message, tensors)
            else:
                others.append((message, tensors))
        self.last_activity = time.monotonic()
        if others:
            self._on_messages(others)
        return stopped

    def _receive_one(
        self, src: int, first: torch.Tensor, copies: SideStream
    ) -> list[tuple[Message, list[torch.Tensor]]]:
        dist.recv(first, src=src, group=self._group, tag=_TAG_HEADER)
        arrived = self._recorder.now() if self._recorder is not None else 0.0
        lengths = first[: 2 * _LENGTH_BYTES].numpy().tobytes()
        header_end = 2 * _LENGTH_BYTES + int.from_bytes(lengths[:_LENGTH_BYTES], "little")
        data_bytes = int.from_bytes(lengths[_LENGTH_BYTES:], "little")
        start = _aligned(header_end)
        end = start + data_bytes
        stream = first
        if header_end > self._first_bytes:  # nothing vouches yet for a header this long: capped
            self._seals.check_length(end, src)
            stream = self._whole(first, src, end)
        header = stream[2 * _LENGTH_BYTES : header_end]
        messages, metas, offsets = self._unsealed(header, src, data_bytes)
        if end > stream.numel():
            stream = self._whole(first, src, end)
        data = stream[start:end]
        # Copies, not views of the buffer: it takes the next stream, views of one storage as
        # several dtypes cannot be saved with torch.save, and a kept view would keep it alive.
        with copies.entered():
            distinct = [
                _rebuilt(data[offset : offset + _nbytes(meta)], meta, self._device)
                for meta, offset in zip(metas, offsets, strict=True)
            ]
        on_gpu = [tensor for tensor in distinct if tensor.is_cuda and tensor.numel()]
        if on_gpu:
            copies.synchronize()  # before the buffer takes the next stream
        for tensor in on_gpu:
            copies.used_on_current(tensor)
        self._record("RECV", messages, arrived, src, end, "from")
        return [(message, [distinct[meta.slot] for meta in message.meta]) for message in messages]

    def _record(
        self, kind: str, messages: list[Message], start: float, peer: int, nbytes: int, way: str
    ) -> None:
        """A stream sent or received, for the timeline: named after its first message."""
        if self._recorder is None:
            return
        first = messages[0]
        name = f"{first.label()} {way} rank {peer}"
        if len(messages) > 1:
            name += f" (+{len(messages) - 1} messages)"
        self._recorder.add(kind, first.microbatch, start, name, peer, nbytes)

    def _whole(self, first: torch.Tensor, src: int, end: int) -> torch.Tensor:
        """A stream of ``end`` bytes: its ``first`` part and the rest, received now."""
        stream = torch.empty(end, dtype=torch.uint8, pin_memory=first.is_pinned())
        stream[: self._first_bytes] = first
        dist.recv(stream[self._first_bytes :], src=src, group=self._group, tag=_TAG_OVERFLOW)
        return stream

    def _unsealed(
        self, header: torch.Tensor, src: int, data_bytes: int
    ) -> tuple[list[Message], list[TensorMeta], list[int]]:
        """A stream's messages, its distinct tensors and their offsets, if its sealed
        ``header`` is the next from ``src`` and describes the ``data_bytes`` it announced."""
        messages: list[Message] = self._seals.unseal(header.numpy().tobytes(), self._group, src)
        metas = _distinct([meta for message in messages for meta in message.meta])
        offsets, described = _layout(metas)
        if described != data_bytes:
            raise ForgedMessageError(
                f"a stream from rank {src} announced {data_bytes} bytes of tensors but its "
                f"messages describe {described}: refused"
            )
        return messages, metas, offsets

    def fail(self, exc: BaseException, tell_peers: bool = True) -> None:
        """The pipeline is broken on this rank (``exc``): every request waiting for a reply
        fails, the rank learns it as a ``FAILED`` message, and (``tell_peers``) so do the
        other ranks, whose waits for this one fail at once instead of at their timeout; once
        only."""
        with self._pending_lock:
            if self._failure is not None:
                return
            self._failure = exc
            pending, self._pending = list(self._pending.values()), {}
        error = ModelParallelError(f"rank {self.rank}: the pipeline's messaging failed: {exc}")
        if tell_peers:
            told = Message(FAILED, 0, body=error_body(self.rank, exc))
            with contextlib.suppress(BaseException):  # best effort: a peer may be gone
                for peer in self.peers:
                    self._send_now(peer, [(told, [])])
        for future in pending:
            future.fail(error)
        self._on_messages([(Message(FAILED, 0, self.rank, body=error), [])])

    # --- shutdown ----------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> bool:
        """Tell every peer we stop, wait for theirs; False if a receiver did not end in time.

        Every rank of the pipeline group must call this (a receiver ends on its peer's stop),
        also after a failure: a peer whose pipeline broke still waits for the others' stops.
        """
        timeout = self.timeout if timeout is None else timeout
        for peer in self.peers:
            with contextlib.suppress(BaseException):  # a peer that is gone sends no stop either
                self._send_now(peer, [(Message(STOP, 0), [])])
        self._posting.drain(timeout)
        self._posting.close()
        with self._posting.lock:
            unfinished, self._unfinished = list(self._unfinished.values()), {}
        for sent in unfinished:
            with contextlib.suppress(BaseException):
                self._finish(sent)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)


def _rebuilt(data: torch.Tensor, meta: TensorMeta, device: torch.device) -> torch.Tensor:
    """A new tensor, on :func:`rebuilt_device`, from its bytes in a received stream."""
    where = rebuilt_device(meta, device)
    if not data.numel():
        return torch.empty(meta.shape, dtype=meta.dtype, device=where)
    tensor = data.view(meta.dtype).view(meta.shape)
    return tensor.clone() if where.type == "cpu" else tensor.to(where, non_blocking=True)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat uint8 tensor (a copy only when it is not contiguous)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _nbytes(meta: TensorMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize


def _distinct(metas: list[TensorMeta]) -> list[TensorMeta]:
    """The metas of a stream's distinct tensors, in slot order (each slot's first use)."""
    distinct: list[TensorMeta] = []
    for meta in metas:
        if meta.slot == len(distinct):
            distinct.append(meta)
    return distinct


def _layout(metas: list[TensorMeta]) -> tuple[list[int], int]:
    """Each tensor's byte offset in a message's data, and the data's length."""
    offsets, end = [], 0
    for meta in metas:
        offsets.append(end)
        end = _aligned(end + _nbytes(meta))
    return offsets, end

"""What travels between the ranks of a pipeline group: message headers, the placeholders that
stand for tensors in them, and the future reply to a request (matched by call id)."""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from dtrain.modelparallel.errors import (
    CommunicationTimeoutError,
    RemoteError,
)

# Message kinds.
FORWARD, FETCH, BACKWARD, REPLY, ERROR, END_STEP, STOP, FAILED, NOTICE = (
    "forward",
    "fetch",
    "backward",
    "reply",
    "error",
    "end_step",
    "stop",
    "failed",
    "notice",
)


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for the ``index``-th tensor of a message inside a pickled structure."""

    index: int


@dataclass(frozen=True)
class OutputRef:
    """Placeholder for an output the receiver computed itself: call ``call_id``'s at ``path``."""

    call_id: int
    path: tuple[Any, ...]


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver needs to rebuild a tensor from its stream's bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    slot: int = 0
    """Which of the stream's distinct tensors this is: a tensor passed twice has one slot."""
    cuda: bool = False
    """Whether the sender's tensor was on a GPU (see :func:`rebuilt_device`)."""


def rebuilt_device(meta: TensorMeta, device: torch.device) -> torch.device:
    """Where a received tensor is rebuilt on a rank that computes on ``device``: a tensor that
    was on a GPU goes to this rank's device, a CPU tensor stays on the CPU.

    Not always the rank's device: a CPU tensor is often on the CPU on purpose (the lengths
    ``pack_padded_sequence`` requires there, a step counter read with ``.item()``), and moving
    it would change what the receiving module's code sees from what the sender's had.
    """
    return device if meta.cuda else torch.device("cpu")


@dataclass
class Message:
    """A message's header; its tensors travel as bytes after the stream's headers and are
    passed alongside it."""

    kind: str
    call_id: int
    source: int = -1
    module: str = ""
    body: Any = None
    microbatch: int = 0
    step: int = 0
    """The leader's step the message belongs to (requests and releases)."""
    meta: tuple[TensorMeta, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        """Short text for the timeline: the kind and the module (``forward blocks.3``)."""
        return f"{self.kind} {self.module}".rstrip()

    def describe(self) -> str:
        """Short text for errors: which request this is."""
        what = f"{self.kind} request #{self.call_id}"
        if self.module:
            what += f" for module {self.module!r}"
        return f"{what} (microbatch {self.microbatch})"


def error_body(rank: int, exc: BaseException) -> RemoteError:
    """What an error reply carries: the exception's type, message and traceback, and our rank.

    A :class:`RemoteError` passing through (a nested call failed further away) keeps its origin.
    """
    if isinstance(exc, RemoteError):
        return exc
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RemoteError(rank, type(exc).__name__, str(exc), text)


class Pending:
    """The future reply to one request."""

    def __init__(self, peer: int, request: Message) -> None:
        self.peer = peer
        self.request = request
        self._done = threading.Event()
        self._reply: tuple[Message, list[torch.Tensor]] | None = None
        self._error: BaseException | None = None

    def resolve(self, message: Message, tensors: list[torch.Tensor]) -> None:
        if message.kind == ERROR:
            self._error = message.body
        else:
            self._reply = (message, tensors)
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def failure(self) -> BaseException | None:
        """The error this request ended with, if it has ended with one."""
        return self._error if self._done.is_set() else None

    def wait(self, timeout: float, rank: int) -> tuple[Message, list[torch.Tensor]]:
        """The reply, handed to its one waiter and not kept (the request's caller keeps this
        future for its error, and the reply's tensors would live as long); raises the remote
        error, or a timeout naming the peer and the request."""
        if not self._done.wait(timeout):
            raise CommunicationTimeoutError(
                f"rank {rank}: no reply from rank {self.peer} to {self.request.describe()} "
                f"within {timeout:g} s"
            )
        if self._error is not None:
            raise self._error
        reply, self._reply = self._reply, None
        assert reply is not None, "a reply is waited for once"
        return reply

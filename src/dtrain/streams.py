"""A CUDA stream beside the one that computes, for collectives and copies that should neither
wait for more of the compute queued before them than their inputs need, nor hold up the compute
queued after them.

On the CPU there are no streams: every call here does nothing, so a CPU code path is the CUDA
one without the ordering, and behaves as it always did.

The rules it follows (torch's "CUDA semantics": streams and the caching allocator):

* work on the side stream that reads what the current stream produced is queued after
  :meth:`SideStream.wait_for_current` (an event recorded on the current stream, which the side
  stream waits for; the CPU does not wait);
* the current stream uses what the side stream produced after :meth:`SideStream.join`, or the
  CPU after :meth:`SideStream.synchronize` (or after the event :meth:`SideStream.recorded`
  gives, on a thread that may wait);
* a tensor allocated on one stream and used on the other is recorded on that other stream
  (``record_stream``), so that its memory is not handed out again, once freed, before that use
  is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class SideStream:
    """A stream of its own on ``device``'s GPU; nothing on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def gpu(self) -> bool:
        return self.stream is not None

    def wait_for_current(self) -> None:
        """Work queued next on the side stream starts after what the current stream holds."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The block's GPU work goes to the side stream (and its allocations come from it)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """Work queued next on the current stream starts after what the side stream holds."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def recorded(self) -> torch.cuda.Event | None:
        """An event after what the side stream holds now (None on the CPU)."""
        if self.stream is None:
            return None
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def synchronize(self) -> None:
        """The CPU waits for what the side stream holds now (not for work queued later)."""
        done = self.recorded()
        if done is not None:
            done.synchronize()

    def used_on_side(self, tensor: torch.Tensor) -> None:
        """``tensor``, allocated on another stream, is also used on the side stream."""
        if self.stream is not None:
            tensor.record_stream(self.stream)

    def used_on_current(self, tensor: torch.Tensor) -> None:
        """``tensor``, allocated on the side stream, is also used on the current one."""
        if self.stream is not None:
            tensor.record_stream(torch.cuda.current_stream(self.device))

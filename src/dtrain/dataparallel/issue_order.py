"""In which order a reducer issues the collectives of its chunks' stages.

Every chunk goes through the strategy's stages in turn (one stage for a flat all-reduce; for the
hierarchical one: reduce-scatter in the host, all-reduce across hosts, all-gather in the host),
each stage a collective on its own group. Within a group every rank issues in chunk order. Across
groups two orders are used:

* **as ready** (gloo): a stage goes as soon as the chunk's previous stage has completed, polled
  during backward, so communication overlaps the backward pass as much as it can. Ranks may
  interleave the groups differently; gloo runs each group on its own connections, so that is
  safe.
* **in order** (NCCL): a chunk's stages go back to back, right when its gradients are ready, so
  every rank issues the same sequence of collectives whatever completes when. NCCL needs that
  (collectives of several communicators on one GPU, issued in different orders on different
  ranks, can wait for each other for ever), and waiting on a NCCL collective only holds the
  reducer's own CUDA stream (not the one backward computes on), so issuing a stage whose input
  is still being reduced costs neither the CPU nor the backward pass anything.
"""

from __future__ import annotations

from collections.abc import Callable


class IssueOrder:
    """How far each stage has issued; which ``(chunk, stage)`` may go next."""

    def __init__(self, chunks: int, stages: int, in_order: bool) -> None:
        self.chunks = chunks
        self.stages = stages
        self.in_order = in_order
        self.issued = [0] * stages
        """Per stage, how many chunks (0, 1, ...) it has issued."""

    def next(
        self, ready: Callable[[int], bool], completed: Callable[[int], bool]
    ) -> tuple[int, int] | None:
        """The ``(chunk, stage)`` to issue now, or None.

        ``ready(c)``: chunk c's gradients are all in (its stage 0 may go); ``completed(c)``:
        chunk c's last issued stage has completed (polled; only used as ready).
        """
        if self.in_order:
            stage = next((s for s in range(1, self.stages) if self.issued[s] < self.issued[0]), 0)
            chunk = self.issued[stage]
            if stage == 0 and (chunk == self.chunks or not ready(chunk)):
                return None
            return chunk, stage
        for stage in range(self.stages):
            chunk = self.issued[stage]
            if chunk == self.chunks:
                continue
            if stage == 0:
                if ready(chunk):
                    return chunk, 0
            elif self.issued[stage - 1] > chunk and completed(chunk):
                return chunk, stage
        return None

    def mark(self, chunk: int, stage: int) -> None:
        assert self.issued[stage] == chunk, "stages issue their chunks in order"
        self.issued[stage] += 1

    def in_flight(self) -> list[tuple[int, int]]:
        """``(chunk, stage)`` of every chunk whose next stage waits for its previous one."""
        return [
            (self.issued[stage], stage)
            for stage in range(1, self.stages)
            if self.issued[stage] < self.issued[stage - 1]
        ]

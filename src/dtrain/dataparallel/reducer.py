"""Averages gradients across ranks during backward, bucket by bucket, overlapping the backward pass.

A post-accumulate-grad hook on every parameter copies its gradient into its bucket's flat buffer
(or finds it already there with ``gradient_as_bucket_view``). When a bucket's last gradient
arrives, its all-reduce starts asynchronously while autograd keeps computing earlier layers.
Buckets start strictly in index order on every rank, which keeps collectives matched without any
negotiation. A final callback queued on the autograd engine then fills in parameters that got no
gradient, waits for the rest, and writes the averages back to ``param.grad``.

A bucket travels as one transfer, or, when the strategy has several stages and the bucket is
over the cap (a parameter larger than the cap has a bucket of its own), as balanced chunks that
pipeline through the stages.

On a GPU the collectives are issued on a stream of the reducer's own (:mod:`dtrain.streams`):
a bucket's reduction waits for the compute stream only up to its gradients, its stages wait
for each other there, and the compute stream waits for the reductions only once backward is
over, where their results are written back. Issued on the compute stream, each wait between two
stages held every backward kernel queued after it until the bucket was reduced: no overlap. On
the CPU (gloo) there are no streams and nothing changes.

The first plan packs parameters in reverse definition order (a guess at backward order). The
first synced backward records the real order in which gradients became ready; rank 0's record
is broadcast (ranks must agree, and autograd's order can differ between them) and the buckets
are rebuilt once in that order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dtrain.dataparallel.buckets import BucketPlan, plan_buckets
from dtrain.dataparallel.compression import Codec
from dtrain.dataparallel.issue_order import IssueOrder
from dtrain.dataparallel.strategies import BufferSpec, StagedAllReduce, Transfer
from dtrain.streams import SideStream


class Reducer:
    """Owns the buckets of one DistributedDataParallel and the hooks that fill them."""

    _in_backward: bool  # set by _reset

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        strategy: StagedAllReduce,
        codec: Codec,
        group: dist.ProcessGroup,
        cap_bytes: int,
        find_unused: bool,
        grad_as_view: bool,
    ) -> None:
        self._names = [name for name, _ in named_params]
        self._params = [param for _, param in named_params]
        self._strategy, self._codec, self._group = strategy, codec, group
        self._world = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0)
        self._cap, self._find_unused, self._grad_as_view = cap_bytes, find_unused, grad_as_view
        self._sizes = [p.numel() * p.element_size() for p in self._params]
        self._kinds = [(p.dtype, p.device) for p in self._params]
        self._side = SideStream(self._kinds[0][1])  # one device per process
        self._plan = plan_buckets(
            self._sizes, list(reversed(range(len(self._params)))), cap_bytes, self._kinds
        )
        self._order_fixed = False
        self._sync = True
        self._allocate()
        self._reset()
        for index, param in enumerate(self._params):
            param.register_post_accumulate_grad_hook(functools.partial(self._on_ready, index))

    @property
    def plan(self) -> BucketPlan:
        return self._plan

    def prepare_forward(self, sync: bool) -> None:
        """Record whether the backward of this forward reduces (False inside ``no_sync``)."""
        self._sync = sync

    # --- during backward ---------------------------------------------------------------------

    def _on_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._sync:
            return  # no_sync: autograd keeps summing into param.grad; the next sync reduces it
        if not self._in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._in_backward = True
        if self._ready[index]:
            raise RuntimeError(
                f"the gradient of {self._names[index]} became ready twice in one backward pass "
                "(reentrant backward, e.g. checkpoint(use_reentrant=True), is not supported)"
            )
        self._mark_ready(index, param.grad)
        self._advance(block=False)

    def _mark_ready(self, index: int, grad: torch.Tensor | None) -> None:
        view = self._views[index]
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        self._ready[index] = True
        self._order.append(index)
        self._pending[self._bucket_of[index]] -= 1

    def _advance(self, block: bool) -> None:
        """Issue every stage that can start; ``block`` waits until no more can be issued.

        Stage 0 of a chunk needs all of its bucket's gradients; stage s > 0 needs the chunk's
        stage s-1 issued (and, as ready, done): :class:`IssueOrder` decides. Blocking waits for
        the lowest chunk with a stage in flight, issues its next stage, then whatever else
        became possible: chunk 0's last stage does not queue behind chunk 5's first. (It also
        never relies on ``is_completed`` after ``wait``: gloo's reduce-scatter work never
        reports completion.)
        """
        while True:
            self._issue()
            waiting = self._issue_order.in_flight()
            if not (block and waiting):
                return
            c, stage = min(waiting)
            self._wait(c)
            self._launch(stage, c)

    def _issue(self) -> None:
        """Issue, in the reducer's order, every stage whose inputs are ready now."""

        def ready(c: int) -> bool:
            return not self._pending[self._chunks[c][0]]

        def completed(c: int) -> bool:
            work = self._transfers[c].work
            assert work is not None
            return work.is_completed()

        while (next_stage := self._issue_order.next(ready, completed)) is not None:
            c, stage = next_stage
            if stage == 0:
                self._side.wait_for_current()  # for the bucket's gradients
                with self._side.entered():
                    wire = self._codec.encode(self._chunks[c][1], self._world)
                self._transfers.append(Transfer(wire))
            else:
                self._wait(c)  # surfaces the collective's error; on CUDA it holds the side stream
            self._launch(stage, c)

    def _launch(self, stage: int, c: int) -> None:
        with self._side.entered():
            self._transfers[c].work = self._strategy.launch(stage, self._transfers[c])
        self._issue_order.mark(c, stage)

    def _wait(self, c: int) -> None:
        """Chunk ``c``'s last issued stage: the CPU waits on gloo, the side stream on NCCL."""
        work = self._transfers[c].work
        assert work is not None
        with self._side.entered():
            work.wait()

    def _finish_backward(self) -> None:
        """End of a synced backward: reduce what is left, then write averages into ``.grad``."""
        self._in_backward = False
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        if missing and not self._find_unused:
            self._advance(block=True)  # finish what every rank started, so the group stays usable
            self._drain()
            self._side.join()
            self._reset()
            names = ", ".join(self._names[i] for i in missing)
            raise RuntimeError(
                f"no gradient reached these parameters in this backward pass: {names}. Pass "
                "find_unused_parameters=True if the forward does not use every parameter."
            )
        for index in reversed(missing):
            # An earlier no_sync backward may have left a gradient to contribute; else zeros.
            self._mark_ready(index, self._params[index].grad)
        locally_used = [param.grad is not None for param in self._params]
        self._advance(block=True)
        self._drain()
        with self._side.entered():  # where the wire tensors were made and reduced
            for transfer, (_, chunk) in zip(self._transfers, self._chunks, strict=True):
                self._codec.decode(transfer.wire, chunk)
        self._side.join()
        used = self._globally_used(locally_used) if self._find_unused else locally_used
        self._write_back(used)
        if not self._order_fixed:
            self._fix_order()
        self._reset()

    def _drain(self) -> None:
        for c in range(len(self._transfers)):
            self._wait(c)

    def _globally_used(self, locally_used: list[bool]) -> list[bool]:
        """Whether any rank had a gradient: parameters no rank used keep ``grad=None``, as alone."""
        flags = torch.tensor(locally_used, dtype=torch.int32, device=self._buffers[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return [bool(flag) for flag in flags.tolist()]

    def _write_back(self, used: list[bool]) -> None:
        for param, view, is_used in zip(self._params, self._views, used, strict=True):
            if not is_used:
                continue
            if self._grad_as_view:
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)

    # --- bucket layout -------------------------------------------------------------------------

    def _fix_order(self) -> None:
        """Rebuild the buckets once, in the ready order rank 0 observed."""
        order = torch.tensor(self._order, dtype=torch.int64, device=self._buffers[0].device)
        dist.broadcast(order, src=self._root, group=self._group)
        self._order_fixed = True
        plan = plan_buckets(self._sizes, order.tolist(), self._cap, self._kinds)
        if plan == self._plan:
            return
        self._plan = plan
        self._allocate()
        if self._grad_as_view:
            for param, view in zip(self._params, self._views, strict=True):
                if param.grad is not None:
                    view.copy_(param.grad)
                    param.grad = view

    def _allocate(self) -> None:
        """Zeroed flat buffers for the plan (padded for the strategy) and a view per parameter."""
        pad = self._strategy.pad_multiple
        specs = []
        for bucket in self._plan.buckets:
            first = self._params[bucket.params[0]]
            numel = sum(self._params[i].numel() for i in bucket.params)
            specs.append(BufferSpec(-(-numel // pad) * pad, first.dtype, first.device))
        self._buffers = self._strategy.buffers(specs)
        for buffer in self._buffers:  # filled on the compute stream, reduced on the side one
            self._side.used_on_side(buffer)
        self._chunks = [
            (b, chunk) for b, buf in enumerate(self._buffers) for chunk in self._split(buf)
        ]
        self._views: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        self._bucket_of = [0] * len(self._params)
        for b, (bucket, buffer) in enumerate(zip(self._plan.buckets, self._buffers, strict=True)):
            offset = 0
            for i in bucket.params:
                param = self._params[i]
                self._views[i] = buffer[offset : offset + param.numel()].view(param.shape)
                self._bucket_of[i] = b
                offset += param.numel()

    def _split(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """A bucket over the cap (one large parameter) as balanced chunks within it, if staged.

        The chunks go through the stages one after another, so one chunk's cross-host stage
        overlaps the next one's in-host stage; with a single stage nothing would overlap.
        """
        count = -(-buffer.numel() * buffer.element_size() // self._cap)
        if self._strategy.num_stages == 1 or count <= 1:
            return [buffer]
        pad = self._strategy.pad_multiple
        return list(buffer.split(-(-buffer.numel() // (count * pad)) * pad))

    def _reset(self) -> None:
        self._ready = [False] * len(self._params)
        self._order: list[int] = []
        self._pending = [len(bucket.params) for bucket in self._plan.buckets]
        self._transfers: list[Transfer] = []
        cuda = self._kinds[0][1].type == "cuda"  # NCCL: every rank issues in one order
        self._issue_order = IssueOrder(len(self._chunks), self._strategy.num_stages, cuda)
        self._in_backward = False

"""What a pipeline rank keeps once a step is over: its parameters, their gradients and the
optimizer's state, nothing of the step's microbatches (activations, received inputs and
gradients, autograd graphs), and without waiting for Python's cycle collector. Held by a pooled
thread's last task, a receiver's or the dispatcher's last stream, or reference cycles through
autograd's nodes (a fetched output's node, its call's record and the record's reply), they
lived on into later steps and raised the ranks' peaks. Nor does it keep the buffers MKL's
allocator gives each thread that multiplies matrices (:mod:`dtrain.modelparallel.heap`)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

import dtrain.modelparallel as smp
from dtrain.modelparallel import heap
from dtrain.modelparallel.pipeline.workers import WorkerPool
from dtrain.modelparallel.transport.message import REPLY, Message, Pending
from tests.modelparallel.harness import run_ranks
from tests.modelparallel.models import ResidualTransformerLM

SETTLE_S = 10.0
"""A pooled thread lets go of its task just after the task's work is over, which may be just
after the step ended: how long a rank waits for what it should not keep to go."""


def _tensors() -> list[torch.Tensor]:
    # By type: isinstance would ask deprecated torch objects for their class, which warns.
    found = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    return [t for t in found if t.device.type == "cpu"]


def _kept(model: smp.DistributedModel, optimizer: Any, batch: tuple[Any, ...]) -> list[str]:
    """Floating-point tensors alive on this rank besides the model's, their gradients, the
    optimizer's state and the batch, and the empty ones autograd keeps (a remote call's anchor);
    the transport's buffers are bytes, not counted."""
    known = {id(t) for t in batch}
    for parameter in model.parameters():
        known |= {id(parameter), id(parameter.grad)}
    known |= {id(b) for b in model.buffers()}
    for state in optimizer.state.values():
        known |= {id(v) for v in state.values() if isinstance(v, torch.Tensor)}
    return [
        f"{tuple(t.shape)} requires_grad={t.requires_grad}"
        for t in _tensors()
        if id(t) not in known and ((t.is_floating_point() and t.numel()) or t.requires_grad)
    ]


def _steps(steps: int) -> list[tuple[list[str], int | None]]:
    """Train a 3-partition LM (4 microbatches, the later ones' backward split on the owners)
    and list, after each step, what the rank holds that it should not, and MKL's bytes."""
    smp.init(
        {
            "pipeline_parallel_degree": 3,
            "microbatches": 4,
            "auto_partition": False,
            "default_partition": 0,
        }
    )
    module = ResidualTransformerLM(seed=0, layers=3, tie_weights=False)
    smp.set_partition(module.blocks[1], 1)
    for part in (module.blocks[2], module.ln_f, module.lm_head):
        smp.set_partition(part, 2)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))

    @smp.step
    def train_step(model: smp.DistributedModel, tokens: torch.Tensor) -> torch.Tensor:
        loss = model(tokens, tokens)["loss"]
        model.backward(loss)
        return loss

    found = []
    gc.collect()
    gc.disable()  # freed when they are no longer needed, not whenever the collector runs
    try:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            float(train_step(model, tokens).reduce_mean())  # the output itself is not kept
            optimizer.step()
            deadline = time.monotonic() + SETTLE_S
            while (kept := _kept(model, optimizer, (tokens,))) and time.monotonic() < deadline:
                time.sleep(0.01)
            found.append((kept, heap.blas_buffer_bytes()))
            dist.barrier()  # the leader's next step would send this rank its next inputs
    finally:
        gc.enable()
    return found


def test_a_rank_keeps_nothing_of_a_step_once_it_is_over() -> None:
    for rank, found in enumerate(run_ranks(3, _steps, 2, timeout=180)):
        kept = [tensors for tensors, _ in found]
        assert kept == [[], []], f"rank {rank} kept, after each step: {found}"
        assert all(held in (0, None) for _, held in found), f"rank {rank}'s MKL buffers: {found}"


def _released(ref: weakref.ref[Any]) -> bool:
    deadline = time.monotonic() + SETTLE_S
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return ref() is None


def test_an_idle_pool_thread_keeps_nothing_of_its_last_task() -> None:
    held = torch.ones(4)
    ref = weakref.ref(held)
    done = threading.Event()

    def task(value: torch.Tensor = held) -> None:
        done.set()

    pool = WorkerPool("test-kept")
    pool.submit(task)
    del task, held
    assert done.wait(10)
    assert _released(ref)


def test_a_waited_reply_is_not_kept_by_its_future() -> None:
    """A remote call's record keeps its future (for the call's error) as long as the graph of
    the call's outputs: the reply's tensors must not live as long."""
    pending = Pending(1, Message(REPLY, 7))
    reply = torch.ones(4)
    ref = weakref.ref(reply)
    pending.resolve(Message(REPLY, 7), [reply])
    del reply
    _, tensors = pending.wait(1.0, 0)
    del tensors
    assert ref() is None

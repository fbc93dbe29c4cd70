"""Messages between two ranks: any tensors (dtypes, shapes, layouts, sizes) arrive intact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtrain.modelparallel.transport import (
    FORWARD,
    REPLY,
    Message,
    Transport,
    map_leaves,
    resolve,
)
from tests.modelparallel.harness import run_ranks

FIRST_SEND = 4096
"""A small first send, so that a message of the test overflows it."""


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(4, 6, generator=g).t(),  # not contiguous
        torch.ones(1).expand(7),  # stride 0
        torch.tensor(2.5),  # 0-dim
        torch.zeros(0, 3),  # empty
        torch.arange(10, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.randn(5, generator=g).half(),
        torch.randn(FIRST_SEND, generator=g),  # larger than the first send: an overflow
    ]


Handler = Callable[[Transport, list[tuple[Message, list[torch.Tensor]]]], None]


def _start(handle: Handler) -> tuple[int, Transport]:
    """This rank and its transport in a world of two; ``handle`` gets the messages."""
    dist.init_process_group("gloo")
    control, data = dist.new_group([0, 1]), dist.new_group([0, 1])
    transport: Transport | None = None

    def on_messages(messages: list[tuple[Message, list[torch.Tensor]]]) -> None:
        assert transport is not None
        handle(transport, messages)

    transport = Transport(
        dist.get_rank(), [0, 1], control, data, torch.device("cpu"), 30.0, on_messages, FIRST_SEND
    )
    return dist.get_rank(), transport


def _echo() -> list[Any]:
    def handle(transport: Transport, messages: list[tuple[Message, list[torch.Tensor]]]) -> None:
        for message, tensors in messages:
            flags = [meta.requires_grad for meta in message.meta]
            reply = Message(REPLY, message.call_id, body=(message.body, flags))
            transport.send(message.source, reply, tensors)

    rank, transport = _start(handle)
    received: list[Any] = []
    if rank == 0:
        for count in (0, 1, len(_tensors())):
            sent = _tensors()[:count]
            request = Message(FORWARD, count, body={"n": count})
            pending = transport.expect(1, request)
            transport.send(1, request, sent)
            reply, tensors = pending.wait(30.0, rank)
            received.append((reply.body[0], tensors))
        grad = torch.randn(3, requires_grad=True)
        sent = [grad * 2, torch.ones(2), torch.arange(2)]
        request = Message(FORWARD, 99)
        pending = transport.expect(1, request)
        transport.send(1, request, sent)
        reply, _ = pending.wait(30.0, rank)
        received.append(reply.body[1])
    dist.barrier()
    assert transport.close()
    dist.destroy_process_group()
    return received


def test_tensors_round_trip_in_one_message() -> None:
    results, _ = run_ranks(2, _echo, timeout=60)
    *echoes, grad_flags = results
    for (body, tensors), count in zip(echoes, (0, 1, len(_tensors())), strict=True):
        assert body == {"n": count}
        expected = _tensors()[:count]
        assert len(tensors) == count
        for got, want in zip(tensors, expected, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)
    assert grad_flags == [True, False, False]  # the receiver knows which need gradients


def test_structures_map_and_resolve() -> None:
    nested = {"a": (1, [2, 3]), "b": None}
    assert map_leaves(nested, lambda v: v if v is None else v * 10) == {
        "a": (10, [20, 30]),
        "b": None,
    }
    assert resolve(nested, ("a", 1, 0)) == 2


def _repeated() -> list[Any]:
    """Rank 0 sends two messages in one stream, both with the same mask and the same tensor
    that needs a gradient; rank 1 says which of the tensors it got are one object."""

    def handle(transport: Transport, messages: list[tuple[Message, list[torch.Tensor]]]) -> None:
        (first, (mask_a, hidden_a)), (second, (mask_b, hidden_b)) = messages
        body = (mask_a is mask_b, hidden_a is hidden_b, torch.equal(mask_b, hidden_b.detach()))
        transport.send(first.source, Message(REPLY, second.call_id, body=body), [])

    rank, transport = _start(handle)
    body = None
    if rank == 0:
        mask = torch.randn(FIRST_SEND)  # larger than the first send: twice would overflow more
        hidden = mask.clone().requires_grad_()
        first, second = Message(FORWARD, 1), Message(FORWARD, 2)
        pending = transport.expect(1, second)
        transport.send_all(1, [(first, [mask, hidden]), (second, [mask, hidden])])
        body, _ = pending.wait(30.0, rank)
        body = body.body
    dist.barrier()
    assert transport.close()
    dist.destroy_process_group()
    return [body]


def test_a_tensor_passed_twice_in_a_stream_travels_once() -> None:
    """A tensor without gradient arrives as one object for both uses; one that needs a
    gradient arrives once per use (each use is its own leaf on the receiver)."""
    results, _ = run_ranks(2, _repeated, timeout=60)
    assert results == [(True, False, True)]

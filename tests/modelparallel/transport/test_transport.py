"""Messages between two ranks: any tensors (dtypes, shapes, layouts, sizes, devices) arrive
intact, on the device the receiving rank keeps them on."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtrain.modelparallel.transport import wire as transport_module
from dtrain.modelparallel.transport.message import (
    FORWARD,
    REPLY,
    Message,
    TensorMeta,
    rebuilt_device,
)
from dtrain.modelparallel.transport.structure import map_leaves, resolve
from dtrain.modelparallel.transport.wire import Transport
from dtrain.streams import SideStream
from tests.modelparallel.harness import first_visible_gpu, run_ranks

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


def _start(handle: Handler, device: torch.device | None = None) -> tuple[int, Transport]:
    """This rank and its transport (computing on ``device``, default the CPU) in a world of
    two; ``handle`` gets the messages."""
    dist.init_process_group("gloo")
    messaging = dist.new_group([0, 1])
    transport: Transport | None = None

    def on_messages(messages: list[tuple[Message, list[torch.Tensor]]]) -> None:
        assert transport is not None
        handle(transport, messages)

    transport = Transport(
        dist.get_rank(),
        [0, 1],
        messaging,
        device or torch.device("cpu"),
        30.0,
        on_messages,
        FIRST_SEND,
    )
    return dist.get_rank(), transport


def _echo_back(transport: Transport, messages: list[tuple[Message, list[torch.Tensor]]]) -> None:
    """Reply with the tensors received, which need gradients and where they were rebuilt."""
    for message, tensors in messages:
        flags = [meta.requires_grad for meta in message.meta]
        devices = [str(t.device) for t in tensors]
        reply = Message(REPLY, message.call_id, body=(message.body, flags, devices))
        transport.send(message.source, reply, tensors)


def _echo() -> list[Any]:
    rank, transport = _start(_echo_back)
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


def test_a_tensor_is_rebuilt_on_the_rank_device_only_if_it_was_on_a_gpu() -> None:
    gpu, cpu = torch.device("cuda", 1), torch.device("cpu")
    from_gpu = TensorMeta((2, 3), torch.float32, True, cuda=True)
    from_cpu = TensorMeta((2, 3), torch.float32, True, cuda=False)
    assert rebuilt_device(from_gpu, gpu) == gpu
    assert rebuilt_device(from_cpu, gpu) == cpu
    assert rebuilt_device(from_gpu, cpu) == cpu  # a rank without a GPU keeps all on the CPU
    assert rebuilt_device(from_cpu, cpu) == cpu


def _cpu_tensors_between_gpu_ranks() -> dict[str, Any]:
    """Both transports think they compute on cuda:1 (this machine has no GPU:
    ``torch.cuda.set_device`` records the threads that call it instead, and the copy streams
    are the CPU's, none); rank 0 sends CPU tensors to rank 1 and gets them back."""
    selected: list[tuple[str, str]] = []

    def record(device: torch.device) -> None:
        selected.append((threading.current_thread().name, str(device)))

    torch.cuda.set_device = record
    transport_module.SideStream = lambda device: SideStream(torch.device("cpu"))
    rank, transport = _start(_echo_back, torch.device("cuda", 1))
    returned: list[torch.Tensor] = []
    if rank == 0:
        request = Message(FORWARD, 1)
        pending = transport.expect(1, request)
        transport.send(1, request, _tensors())
        _, returned = pending.wait(30.0, rank)
    dist.barrier()
    assert transport.close()
    dist.destroy_process_group()
    return {"selected": selected, "returned": returned}


def test_receivers_start_on_the_rank_gpu_and_cpu_tensors_stay_on_the_cpu() -> None:
    first, second = run_ranks(2, _cpu_tensors_between_gpu_ranks, timeout=60)
    for rank, seen in enumerate((first, second)):
        peer = 1 - rank
        assert (f"dtrain-mp-receiver-{rank}-from-{peer}", "cuda:1") in seen["selected"]
    for got, want in zip(first["returned"], _tensors(), strict=True):
        assert got.device == torch.device("cpu") and torch.equal(got, want)


def _cpu_and_gpu_tensors_on_one_gpu() -> list[Any]:
    """Two ranks computing on one GPU (a gloo world) echo a CPU and a GPU tensor."""
    rank, transport = _start(_echo_back, torch.device("cuda", 0))
    result: list[Any] = []
    if rank == 0:
        sent = [torch.arange(6.0).view(2, 3), torch.arange(4.0, device="cuda")]
        request = Message(FORWARD, 1)
        pending = transport.expect(1, request)
        transport.send(1, request, sent)
        reply, returned = pending.wait(30.0, rank)
        _, _, rebuilt_on = reply.body
        result = [rebuilt_on, [str(t.device) for t in returned]]
        result.append(all(torch.equal(a, b) for a, b in zip(returned, sent, strict=True)))
    dist.barrier()
    assert transport.close()
    dist.destroy_process_group()
    return result


@pytest.mark.gpu
def test_on_a_gpu_rank_a_received_cpu_tensor_stays_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())
    result, _ = run_ranks(2, _cpu_and_gpu_tensors_on_one_gpu, timeout=120)
    assert result == [["cpu", "cuda:0"], ["cpu", "cuda:0"], True]


def _gpu_tensors_round_trip(gpus: int) -> list[Any]:
    """Rank 0 sends rank 1 every kind of tensor from its GPU, one made by a kernel still
    running when it is sent, and compares what comes back at once (on the default stream)."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % gpus)
    torch.cuda.set_device(device)
    rank, transport = _start(_echo_back, device)
    result: list[Any] = []
    if rank == 0:
        busy = torch.randn(2048, 2048, device=device)
        sent = [tensor.to(device) for tensor in _tensors()] + [busy @ busy]
        request = Message(FORWARD, 1)
        pending = transport.expect(1, request)
        transport.send(1, request, sent)
        reply, returned = pending.wait(30.0, rank)
        _, _, rebuilt_on = reply.body
        result = [set(rebuilt_on), {str(t.device) for t in returned}]
        result.append([torch.equal(a, b) for a, b in zip(returned, sent, strict=True)])
    dist.barrier()
    assert transport.close()
    dist.destroy_process_group()
    return result


@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [1, 2])
def test_gpu_tensors_arrive_whole_on_the_receivers_gpu(
    gpus: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through pinned memory and copy streams; both ranks on one GPU, or on a GPU each."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")
    if gpus == 1:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())
    result, _ = run_ranks(2, _gpu_tensors_round_trip, gpus, timeout=120)
    assert result[:2] == [{f"cuda:{1 % gpus}"}, {"cuda:0"}]
    assert all(result[2])

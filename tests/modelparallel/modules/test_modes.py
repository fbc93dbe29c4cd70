"""Grad mode and autocast reach every thread and partition that computes a step's work."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.modules.modes import Autocast, ComputeMode
from tests.modelparallel.equivalence import init_smp
from tests.modelparallel.harness import run_ranks

BF16 = Autocast("cpu", "bfloat16", True)


def _in_thread(mode: ComputeMode) -> ComputeMode:
    seen: list[ComputeMode] = []

    def work() -> None:
        with mode.applied():
            seen.append(ComputeMode.current())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return seen[0]


def test_the_modes_of_one_thread_apply_on_another() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        mode = ComputeMode.current()
    assert mode == ComputeMode(grad=False, autocast=(BF16,))
    assert _in_thread(mode) == mode
    assert _in_thread(ComputeMode()) == ComputeMode()


def test_applying_the_plain_mode_turns_a_threads_autocast_off() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with ComputeMode().applied():
            assert not torch.is_autocast_enabled("cpu")
            assert torch.is_grad_enabled()
        assert torch.is_autocast_enabled("cpu")


def test_the_wire_form_round_trips_and_refuses_unknown_regions() -> None:
    mode = ComputeMode(grad=False, autocast=(BF16,))
    assert ComputeMode.from_wire(mode.to_wire()) == mode
    with pytest.raises(ValueError, match="unknown autocast region"):
        ComputeMode.from_wire({"grad": True, "autocast": [["cpu", "Tensor", True]]})
    with pytest.raises(ValueError, match="unknown autocast region"):
        ComputeMode.from_wire({"grad": True, "autocast": [["tpu", "bfloat16", True]]})


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.relu(self.first(x)))


def _inputs() -> Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _modes_across_partitions() -> dict[str, Any]:
    """The second layer runs on partition 1: its outputs under each way of setting a mode."""
    dist.init_process_group("gloo")
    init_smp(2, "interleaved", microbatches=2, auto=False)
    module = _TwoLayers()
    smp.set_partition(module.second, 1)
    model = smp.DistributedModel(module)

    @smp.step
    def autocast_inside(model: smp.DistributedModel, x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        model.backward(out.float().sum())
        return out

    @smp.step
    def plain(model: smp.DistributedModel, x: Tensor) -> tuple[Tensor, bool]:
        out = model(x)
        return out, out.requires_grad

    seen: dict[str, Any] = {}
    out = autocast_inside(model, _inputs())
    seen["inside"] = out.concat() if smp.pp_rank() == 0 else None
    grads = {n: p.grad.clone() for n, p in model.local_named_parameters()}
    seen["grads"] = grads
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen["around"] = plain(model, _inputs())[0].concat()
    with torch.no_grad():
        seen["no_grad"] = plain(model, _inputs())[1][0]
    smp.shutdown()
    dist.destroy_process_group()
    return seen


def test_autocast_and_no_grad_reach_the_other_partition() -> None:
    rank0, rank1 = run_ranks(2, _modes_across_partitions, timeout=120)
    module = _TwoLayers()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = module(_inputs())
    expected.float().sum().backward()
    for key in ("inside", "around"):
        assert rank0[key].dtype == torch.bfloat16, f"{key}: partition 1 ignored autocast"
        torch.testing.assert_close(rank0[key], expected.detach(), rtol=1e-2, atol=1e-2)
    assert rank0["no_grad"] is False, "a step under no_grad built a graph"
    grads = {**rank0["grads"], **rank1["grads"]}
    assert set(grads) == {"first.weight", "first.bias", "second.weight", "second.bias"}
    for name, parameter in module.named_parameters():
        # model.backward averages over the 2 microbatches.
        torch.testing.assert_close(grads[name] * 2, parameter.grad, rtol=2e-2, atol=2e-2)

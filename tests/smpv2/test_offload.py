"""Activation offloading over tensor-parallel weights (:mod:`dtrain.smpv2.offload`), in one
process: torch's ``offload_wrapper`` fails on a model whose weights are DTensors, as AWS's SMP v2
script's ``sm_activation_offloading`` met it after ``tsm.transform``; dtrain's gives the gradients
of no offloading, saves copies (not the tensors themselves), and is what ``torch.sagemaker``
serves under torch's name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtrain.smpv2.offload import OffloadWrapper, offload_wrapper, save_on_host


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def split_model() -> nn.Module:
    """:func:`plain_model` split as ``tsm.transform`` splits a feed-forward (over a mesh of one
    rank): its weights are DTensors."""
    mesh = DeviceMesh("cpu", [0])
    return parallelize_module(plain_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    model(torch.arange(24.0).reshape(3, 8) / 24).square().sum().backward()
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.named_parameters()
    }


def test_torchs_offload_wrapper_fails_on_dtensor_weights(world_of_one: None) -> None:
    model = checkpoint_wrapper.OffloadWrapper(split_model())
    with pytest.raises(RuntimeError, match=r"got mixed torch\.Tensor and DTensor"):
        gradients(model)


def test_offloaded_dtensors_give_the_gradients_torchs_offloading_gives_plain_tensors(
    world_of_one: None,
) -> None:
    """Exactly those of torch's offloading of the unsplit model (its host copies are contiguous,
    which may round differently from no offloading: within float32's precision of it)."""
    expected = gradients(checkpoint_wrapper.OffloadWrapper(plain_model()))
    got = gradients(offload_wrapper(split_model()))
    assert got.keys() == expected.keys()  # torch's wrapper names its module's parameters as it
    without = gradients(split_model())
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0)
        torch.testing.assert_close(got[name], without[name])


def test_saved_tensors_are_copies_rebuilt_as_they_were(world_of_one: None) -> None:
    """What backward reads is a copy (offloaded), of the same kind, placement and values."""
    weight = split_model()[0].weight
    plain = torch.randn(3, 4)
    hooks = save_on_host()
    for tensor in (weight, plain):
        back = hooks.unpack_hook(hooks.pack_hook(tensor))
        assert type(back) is type(tensor.data)
        if isinstance(tensor, DTensor):
            assert isinstance(back, DTensor)
            assert back.placements == tensor.placements and back.device_mesh == tensor.device_mesh
            assert back.to_local().data_ptr() != tensor.to_local().data_ptr()
            torch.testing.assert_close(back.to_local(), tensor.to_local().detach())
        else:
            assert back.data_ptr() != tensor.data_ptr()
            torch.testing.assert_close(back, tensor)


def test_torch_sagemaker_serves_it_under_torchs_name() -> None:
    import torch.sagemaker  # noqa: F401

    assert checkpoint_wrapper.offload_wrapper is offload_wrapper
    wrapped = checkpoint_wrapper.offload_wrapper(nn.Linear(2, 2))
    assert isinstance(wrapped, OffloadWrapper)
    assert isinstance(wrapped, checkpoint_wrapper.OffloadWrapper)  # torch's checks still hold

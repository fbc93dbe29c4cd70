"""SMP's ``post_param_init_fn`` on torch's FSDP, in a world of one process: called once per unit
on the unit's root, after ``param_init_fn`` has created every module of the unit and before FSDP
flattens it, so that tied weights untied by module-by-module creation are tied again."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    FullyShardedDataParallel as TorchFSDP,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from dtrain.smpv2.fsdp import FullyShardedDataParallel
from dtrain.smpv2.post_init import UnitInit, unit_modules


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class TiedModel(nn.Module):
    """An embedding and an output layer sharing one weight, with HF's ``tie_weights``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 8, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_units_modules_are_walked_as_torch_creates_them() -> None:
    model = TiedModel()
    order = [type(m).__name__ for m in unit_modules(model)]
    assert order[:4] == ["TiedModel", "Embedding", "Sequential", "Linear"]  # breadth first
    assert order.count("Block") == 2 and len(order) == len(list(model.modules()))


def test_post_param_init_fn_reties_each_unit_once_it_is_created(world_of_one: None) -> None:
    with torch.device("meta"):
        model = TiedModel()
    created: list[nn.Module] = []
    posts: list[tuple[str, bool]] = []

    def param_init_fn(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)
        for param in module.parameters(recurse=False):
            nn.init.normal_(param)
        created.append(module)

    def post_param_init_fn(module: nn.Module) -> None:
        # Every module of the unit is created by now; FSDP has not flattened it yet.
        whole = all(not p.is_meta for p in module.parameters())
        posts.append((type(module).__name__, whole))
        if hasattr(module, "tie_weights"):
            assert module.head.weight is not module.embed.weight  # to_empty untied them
            module.tie_weights()

    modules = list(model.modules())
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        param_init_fn=param_init_fn,
        post_param_init_fn=post_param_init_fn,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    assert posts == [("Block", True), ("Block", True), ("TiedModel", True)]
    assert sorted(map(id, created)) == sorted(map(id, modules))  # each once
    # One weight shared by embedding and head: FSDP holds it once.
    embed, head = model.embed.weight, model.head.weight
    assert embed.data_ptr() == head.data_ptr()
    held = sum(unit._flat_param.numel() for unit in TorchFSDP.fsdp_modules(wrapped))
    assert held == sum(p.numel() for p in model.parameters())  # parameters() dedups


def test_post_param_init_fn_needs_param_init_fn_and_no_ignored_modules(world_of_one: None) -> None:
    def post(module: nn.Module) -> None:
        pass

    with pytest.raises(ValueError, match="post_param_init_fn runs once param_init_fn"):
        FullyShardedDataParallel(Block(), post_param_init_fn=post)
    block = Block()
    with pytest.raises(ValueError, match="with ignored_modules or ignored_states is not avail"):
        FullyShardedDataParallel(
            block, param_init_fn=post, post_param_init_fn=post, ignored_modules=[block.inner[0]]
        )


def test_unit_init_creates_each_module_once_whatever_torch_calls() -> None:
    model = TiedModel()
    calls: list[nn.Module] = []
    init = UnitInit(calls.append, functools.partial(calls.append))
    for module in unit_modules(model):  # as torch's loop calls it
        init(module)
    assert calls[:-1] == unit_modules(model) and calls[-1] is model


def test_the_fsdp_torch_auto_wraps_counts_as_the_scripts_fsdp(world_of_one: None) -> None:
    wrapped = FullyShardedDataParallel(
        TiedModel(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
    )
    units = TorchFSDP.fsdp_modules(wrapped)
    assert [type(u) for u in units] == [FullyShardedDataParallel, TorchFSDP, TorchFSDP]
    assert all(isinstance(u, FullyShardedDataParallel) for u in units)
    assert issubclass(TorchFSDP, FullyShardedDataParallel)
    assert not isinstance(nn.Linear(1, 1), FullyShardedDataParallel)

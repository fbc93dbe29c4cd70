"""Pipelines x tensor parallelism: pp=2 x tp=2 (world 4, two microbatches) trains a plain model
marked with smp.set_tensor_parallelism to the one-process losses and parameters, under the
default placement (tp peers are neighbours; automatic partition: rank 0's tp group profiles
together) and under ``spread`` (tp peers are ranks 0 and 2; manual placement, kept by the
swapped modules). Without processes: a split block cut by the partition fails naming it, the
scaled-batch mark travels with a request's compute mode, and the tp styles' hooks are neither
replayed nor run where their module does not compute."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.pipeline import hooks, modes
from dtrain.modelparallel.tensor import shards
from tests.modelparallel.harness import run_ranks
from tests.modelparallel.test_tensor_equivalence import (
    GLOBAL_BATCH,
    STEPS,
    _batch,
    _mlp,
    _mlp_loss,
    _one_process,
    _optimizer,
)


def _on_ranks(placement: str, auto: bool) -> dict[str, Any]:
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "tensor_parallel_degree": 2,
            "ddp": True,
            "microbatches": 2,
            "placement_strategy": placement,
            "auto_partition": auto,
            "default_partition": 0,
        }
    )
    module = _mlp()
    smp.set_tensor_parallelism(module)
    if not auto:
        smp.set_partition(module[3], 1)  # a Linear, swapped when wrapped: keeps its partition
        smp.set_partition(module[4], 1)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(_optimizer(model.parameters()))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = _mlp_loss(model, ids, mask)
        model.backward(loss)
        return loss

    rows = GLOBAL_BATCH // smp.dp_size()
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    losses = []
    for step in range(STEPS):
        ids, mask = _batch(step)
        optimizer.zero_grad()
        losses.append(float(train_step(model, ids[mine], mask[mine]).reduce_mean()))
        optimizer.step()
    plan = model.partition_plan()
    return {
        "losses": losses,
        "params": model.state_dict(),
        "split": sum(isinstance(p, DTensor) for p in model.local_parameters()),
        "owners": [plan.owner(str(i)) for i in range(5)],
        "groups": (smp.get_tp_group(), smp.get_pp_group()),
    }


@pytest.mark.parametrize(("placement", "auto"), [("cluster", True), ("spread", False)])
def test_pipeline_by_tensor_parallel_training_equals_one_process(
    placement: str, auto: bool
) -> None:
    ranks = run_ranks(4, _on_ranks, placement, auto, timeout=180)
    losses, params, _ = _one_process("mlp")
    peers = {"cluster": ([0, 1], [0, 2]), "spread": ([0, 2], [0, 1])}[placement]
    assert ranks[0]["groups"] == peers
    tp_groups = [[0, 1], [2, 3]] if placement == "cluster" else [[0, 2], [1, 3]]
    for group in tp_groups:  # a tp group's ranks are one stage: its loss is their rows' mean
        mean = [sum(ranks[r]["losses"][step] for r in group) / 2 for step in range(STEPS)]
        assert mean == pytest.approx(losses, rel=1e-5)
    for rank in ranks:
        assert rank["owners"] == ranks[0]["owners"]
        assert rank["owners"][0] == 0 and rank["owners"][4] == 1
        if not auto:
            assert rank["owners"] == [0, 0, 0, 1, 1]
        assert rank["split"] > 0  # every stage holds shards of a distributed module
        assert rank["params"].keys() == params.keys()
        for key, value in params.items():
            torch.testing.assert_close(rank["params"][key], value, rtol=1e-4, atol=1e-6)


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        setattr(self, shards.SPLIT_BLOCK, True)


def test_a_split_block_cut_by_the_partition_fails_naming_both_partitions() -> None:
    root = nn.Sequential(nn.Linear(2, 2), _Split())
    same = {"": 0, "0": 0, "1": 1, "1.inner": 1}
    shards.check_partition(root, same.__getitem__)
    cut = {**same, "1.inner": 0}
    with pytest.raises(ModelParallelError) as caught:
        shards.check_partition(root, cut.__getitem__)
    assert str(caught.value) == (
        "smp.DistributedModel: module '1' (_Split) is split over the tensor-parallel group and "
        "runs whole on one pipeline partition, but its submodule '1.inner' (Linear) is placed "
        "on partition 0 and it on 1; allowed: the same partition"
    )
    assert shards.split_blocks(root) == {"1"}


def test_the_scaled_batch_mark_travels_with_the_compute_mode() -> None:
    assert not modes.ComputeMode.current().tensor_region
    with modes.tensor_region():
        mode = modes.ComputeMode.current()
    assert mode.tensor_region and not modes.in_tensor_region()
    assert modes.ComputeMode.from_wire(mode.to_wire()) == mode
    seen: list[bool] = []

    def work() -> None:
        with mode.applied():
            seen.append(modes.in_tensor_region())
        seen.append(modes.in_tensor_region())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [True, False]


def test_hooks_marked_local_are_not_replayed_and_dropped_where_not_computed() -> None:
    layer = nn.Linear(2, 2)
    style = layer.register_forward_pre_hook(lambda module, args: None)
    assert hooks.hooked_submodules("", [("layer", layer)]) == ["layer"]
    hooks.run_where_computed(layer, {style.id})
    assert hooks.hooked_submodules("", [("layer", layer)]) == []
    user = layer.register_forward_hook(lambda module, args, out: None)
    assert hooks.hooked_submodules("", [("layer", layer)]) == ["layer"]
    hooks.drop_local_hooks(layer)
    assert list(layer._forward_pre_hooks) == [] and list(layer._forward_hooks) == [user.id]

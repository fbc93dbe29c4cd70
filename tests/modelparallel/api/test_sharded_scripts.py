"""The sharded path AWS's v1 scripts take without the distributed transformer, on 2 gloo ranks.

GPT-NeoX's ``sdp_utils.py`` (shared by the BLOOM, Flan-T5, Falcon and GPT-J scripts) reads
DeepSpeed's names at ``sharded_data_parallel_degree`` above 1: it lays each param group's
shards end to end by ``p.ds_tensor.ds_numel``, takes every parameter's fp32 shard from
``optimizer.fp32_partitioned_groups_flat`` and logs each parameter's norm as its shards'
squared norms summed over ``optimizer.ds_param_shard_group``. Here a HF GPT-2 at sdp=2 does
that with ``FusedLAMB``: it trains like one process with ``FusedLAMB`` on the global batch,
the logged norms are the parameters' after every step, and its partial checkpoint is put back
together whole without a job. At tp=2, ``get_distribution_axis`` names the split dimensions.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.api.sharded_checkpoint import (
    get_full_state_dict_from_sharded_data_parallel_checkpoint,
)
from dtrain.modelparallel.api.smp_utils import get_distribution_axis
from dtrain.modelparallel.optimizers import FusedLAMB
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import run_ranks

STEPS = 3
LR = 0.01
MAX_NORM = 0.5
"""FusedLAMB's clipping: below the gradients' global norm in every step (checked)."""


def build() -> nn.Module:
    """The HF GPT-2 case with one more token: its embedding's shards are uneven (33 and 32
    rows)."""
    model = hf_cases.build("gpt2")
    torch.manual_seed(1)
    model.resize_token_embeddings(hf_cases.VOCAB + 1, mean_resizing=False)
    return model


def groups_by_decay(module: nn.Module) -> list[dict[str, Any]]:
    """Weights with decay, biases and norms without, as AWS's scripts group them."""
    decayed, kept = [], []
    for name, param in module.named_parameters():
        (kept if name.endswith("bias") or ".ln_" in name else decayed).append(param)
    return [{"params": decayed}, {"params": kept, "weight_decay": 0.0}]


def reference() -> tuple[list[float], list[dict[str, float]], dict[str, Tensor], list[float]]:
    """One process, FusedLAMB on the global batch: losses, parameter norms after each step,
    the final parameters and the gradients' global norms."""
    model = build()
    optimizer = FusedLAMB(groups_by_decay(model), lr=LR, max_grad_norm=MAX_NORM)
    losses, norms, grad_norms = [], [], []
    for index in range(STEPS):
        optimizer.zero_grad()
        loss = model(**hf_cases.CASES["gpt2"].batch(index))["loss"]
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        optimizer.step()
        losses.append(loss.item())
        norms.append({n: float(p.detach().norm()) for n, p in model.named_parameters()})
    return losses, norms, model.state_dict(), grad_norms


def sharded(folder: str) -> dict[str, Any]:
    """On every rank: sdp=2 as the scripts drive it, then the axes at tp=2."""
    dist.init_process_group("gloo")
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0})
    model = smp.DistributedModel(build())
    groups = groups_by_decay(model.get_module())
    offsets = []  # the scripts' build_param_id_to_offset, before the optimizer is wrapped
    for group in groups:
        offset, mine = 0, {}
        for param in group["params"]:
            mine[id(param)] = (offset, param.ds_tensor.ds_numel)
            offset += param.ds_tensor.ds_numel
        offsets.append(mine)
    optimizer = smp.DistributedOptimizer(FusedLAMB(groups, lr=LR, max_grad_norm=MAX_NORM))
    buffers = {  # the scripts' build_param_id_to_buffer
        key: optimizer.fp32_partitioned_groups_flat[i].narrow(0, offset, size)
        for i, group_offsets in enumerate(offsets)
        for key, (offset, size) in group_offsets.items()
    }

    @smp.step
    def train_step(model: smp.DistributedModel, batch: dict[str, Tensor]) -> Tensor:
        loss = model(**batch)["loss"]
        model.backward(loss)
        return loss

    rows = hf_cases.GLOBAL_BATCH // smp.dp_size()
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    losses, norms = [], []
    for index in range(STEPS):
        optimizer.zero_grad()
        batch = {k: v[mine] for k, v in hf_cases.CASES["gpt2"].batch(index).items()}
        loss = train_step(model, batch).reduce_mean().detach()
        optimizer.step()
        dist.all_reduce(loss)
        losses.append(loss.item() / 2)
        logged = {}  # the scripts' log_param_norms
        for name, param in model.get_module().named_parameters():
            squared = torch.linalg.norm(buffers[id(param)]) ** 2
            dist.all_reduce(squared, group=optimizer.ds_param_shard_group)
            logged[name] = math.sqrt(squared.item())
        norms.append(logged)
    held = {n: p.ds_tensor.ds_numel for n, p in model.get_module().named_parameters()}
    axes = {n: get_distribution_axis(p) for n, p in model.get_module().named_parameters()}
    full = model.state_dict()
    smp.save_checkpoint(folder, "sdp", model=model, optimizer=optimizer)
    smp.shutdown()

    smp.init({"ddp": True, "tensor_parallel_degree": 2})
    with smp.tensor_parallelism():
        module = hf_cases.build("gpt2")
    split = smp.DistributedModel(module).get_module()
    tp_axes = {n: get_distribution_axis(p) for n, p in split.named_parameters()}
    smp.shutdown()
    dist.destroy_process_group()
    return {
        "losses": losses,
        "norms": norms,
        "held": held,
        "axes": axes,
        "full": full,
        "tp_axes": tp_axes,
    }


def test_sdp_utils_names_train_log_and_put_the_checkpoint_together(tmp_path: Path) -> None:
    results = run_ranks(2, sharded, str(tmp_path), timeout=120)
    losses, norms, params, grad_norms = reference()
    assert min(grad_norms) > MAX_NORM, f"LAMB's clipping never acted ({grad_norms})"
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=0, msg=f"rank {rank}")
        for step, (logged, expected) in enumerate(zip(got["norms"], norms, strict=True)):
            for name, value in expected.items():
                assert abs(logged[name] - value) <= 1e-4 * max(value, 1.0), (rank, step, name)
        for name, value in params.items():
            torch.testing.assert_close(got["full"][name], value, rtol=0, atol=1e-5, msg=name)
        assert set(got["axes"].values()) == {None}  # sharded data parallelism splits no tp axis
    whole = {n: p.numel() for n, p in build().named_parameters()}
    assert {n: sum(r["held"][n] for r in results) for n in whole} == whole  # every element once
    assert any(r["held"][n] != whole[n] // 2 for r in results for n in whole)  # uneven pieces
    rebuilt = get_full_state_dict_from_sharded_data_parallel_checkpoint(tmp_path)
    assert rebuilt.keys() == results[0]["full"].keys()
    for name, value in results[0]["full"].items():
        assert torch.equal(rebuilt[name], value), name
    # DistributedTransformerLMHead: the projections into the heads and the MLP split by output
    # features (column-parallel), those out of them by input features (row-parallel).
    tp_axes = results[0]["tp_axes"]
    assert tp_axes == results[1]["tp_axes"]

    def axes(*ends: str) -> set[int | None]:
        return {axis for name, axis in tp_axes.items() if name.endswith(ends)}

    assert axes("query.weight", "key.weight", "value.weight", "dense1.weight") == {0}
    assert axes("attention.dense.weight", "dense2.weight") == {1}
    assert axes("layernorm.weight", "layernorm.bias") == {None}

"""The pipeline on CUDA, run where GPUs are (skipped elsewhere).

Two ranks on one GPU: a host that runs more processes than it has GPUs gets a gloo world from
``smp.init``, each rank computing on a shared GPU, with the pipeline's tensors staged through
host memory. The script is SMP's usual one: the model made on the CPU, the batches moved to the
GPU in the loop (or left on the CPU, which the step moves). It must train like one process on
that GPU running the same microbatches, whichever device rank 0 profiles on.

Then what shows with AMP, across GPUs, or with GPU memory: pp=2 × dp=2 with AMP resuming a
checkpoint before its first step, objects with GPU tensors between ranks (on GPUs 0 and 1 where
there are two, else sharing one), and what rank 0's profiling of the whole model leaves cached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dtrain.modelparallel as smp
from dtrain.modelparallel import state
from tests.modelparallel.equivalence import CASES, LR, Trained, case_pipeline, replica_rows
from tests.modelparallel.harness import first_visible_gpu, run_ranks, sum_step

pytestmark = pytest.mark.gpu

CASE = "branchy"
"""Linear layers only (no cuDNN convolution, whose algorithms may differ between runs), with a
data-dependent branch and modules on both partitions."""
STEPS = 4
MICROBATCHES = 2


def _pipelined(trace_device: str, auto: bool, batches_on_gpu: bool) -> dict[str, Any]:
    """One rank of pp=2 on one GPU: how it was set up, and rank 0's training."""
    case = CASES[CASE]
    config: dict[str, Any] = {
        "pipeline_parallel_degree": 2,
        "microbatches": MICROBATCHES,
        "auto_partition": auto,
    }
    if not auto:
        config["default_partition"] = 0
    smp.init(config)  # two processes, one GPU: a gloo world, both ranks on cuda:0
    model, step = case_pipeline(case, auto, trace_device=trace_device)  # made on the CPU
    device = torch.device("cuda")  # SMP's scripts: the GPU smp.init selected
    losses = []
    for index in range(STEPS):
        x, y = case.batch(index)
        if batches_on_gpu:
            x, y = x.to(device), y.to(device)
        losses.append(step(x, y))
    profile = model.engine.partitioner.profile
    return {
        "backend": dist.get_backend(),
        "device": str(state.current().device),
        "local_devices": sorted({str(p.device) for p in model.local_parameters()}),
        "profiled_on": profile.device if profile is not None else None,
        "trained": Trained(losses, model.state_dict()),
    }


def _one_process(device: torch.device) -> Trained:
    """The same microbatches in one process on ``device``: each microbatch's loss over the
    microbatch count backward, then one SGD step."""
    case = CASES[CASE]
    model = case.build().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for index in range(STEPS):
        x, y = (t.to(device) for t in case.batch(index))
        optimizer.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            loss = case.loss(model, xm, ym)
            (loss / MICROBATCHES).backward()
            total += loss.item()
        optimizer.step()
        losses.append(total / MICROBATCHES)
    return Trained(losses, {k: v.detach().cpu() for k, v in model.state_dict().items()})


@pytest.mark.parametrize(
    ("trace_device", "auto", "batches_on_gpu"),
    [("gpu", True, True), ("cpu", True, True), ("gpu", False, False)],
)
def test_two_ranks_on_one_gpu_train_like_one_process_on_it(
    trace_device: str, auto: bool, batches_on_gpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())
    ranks = run_ranks(2, _pipelined, trace_device, auto, batches_on_gpu, timeout=300)
    for seen in ranks:
        assert (seen["backend"], seen["device"]) == ("gloo", "cuda:0")
        assert seen["local_devices"] in ([], ["cuda:0"])
    if auto:
        assert ranks[0]["profiled_on"] == ("cuda:0" if trace_device == "gpu" else "cpu")
    got, expected = ranks[0]["trained"], _one_process(torch.device("cuda", 0))
    torch.testing.assert_close(got.losses, expected.losses, rtol=1e-4, atol=1e-6)
    assert got.params.keys() == expected.params.keys()
    for name, value in expected.params.items():
        torch.testing.assert_close(got.params[name], value, rtol=1e-4, atol=1e-5, msg=name)


def _used_gpus(ranks: int) -> set[str]:
    """The GPUs ranks 0 to ``ranks - 1`` of one host compute on: one each while there are
    enough, else shared (a gloo world)."""
    return {f"cuda:{rank % torch.cuda.device_count()}" for rank in range(ranks)}


PP2_DP2 = {
    "pipeline_parallel_degree": 2,
    "microbatches": MICROBATCHES,
    "ddp": True,
    "auto_partition": False,
    "default_partition": 0,
}
SAVED_AT, AMP_STEPS = 2, 4


def _amp_training(fused: bool, shift: float) -> tuple[Any, Any, Any, Any]:
    """The case's model (its parameters shifted by ``shift``) split by hand, fused or plain
    Adam, smp's GradScaler, and one AMP step of this replica's share of a batch."""
    case = CASES[CASE]
    module = case.build()
    with torch.no_grad():
        for param in module.parameters():
            param.add_(shift)
    for name, partition in case.split.items():
        smp.set_partition(module.get_submodule(name), partition)
    model = smp.DistributedModel(module)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    optimizer = smp.DistributedOptimizer(adam)
    scaler = smp.amp.GradScaler()

    @smp.step
    def train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> Any:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = case.loss(model, x, y)
        model.backward(scaler.scale(loss))
        return loss

    def step(index: int) -> float:
        x, y = (t.to("cuda") for t in replica_rows(*case.batch(index)))
        optimizer.zero_grad()
        loss = float(train_step(model, x, y).reduce_mean())
        scaler.step(optimizer)
        scaler.update()
        return loss

    return model, optimizer, scaler, step


def _resumed_before_the_first_step(folder: str, fused: bool) -> dict[str, Any]:
    """One rank: train, save, go on; then a fresh model resumes before its first step."""
    smp.init(PP2_DP2)
    model, optimizer, scaler, step = _amp_training(fused, shift=0.0)
    for index in range(SAVED_AT):
        step(index)
    content = {"scaler": scaler.state_dict()}
    smp.save_checkpoint(folder, "saved", model=model, optimizer=optimizer, user_content=content)
    continued = [step(index) for index in range(SAVED_AT, AMP_STEPS)]
    smp.reset()
    model, optimizer, scaler, step = _amp_training(fused, shift=1.0)  # the checkpoint's must win
    scaler.load_state_dict(smp.resume_from_checkpoint(folder)["scaler"])  # on the CPU until...
    resumed = [step(index) for index in range(SAVED_AT, AMP_STEPS)]  # ...partitioning moves it
    misplaced = []
    for name, param in model.local_named_parameters():
        for key, value in optimizer.state[param].items():
            on_cpu = key == "step" and not fused  # where torch's Adam keeps it
            if value.device != (torch.device("cpu") if on_cpu else param.device):
                misplaced.append(f"{name}.{key} on {value.device}")
    return {
        "device": str(state.current().device),
        "continued": continued,
        "resumed": resumed,
        "misplaced": misplaced,
    }


@pytest.mark.parametrize("fused", [False, True])
def test_pp2_dp2_with_amp_resumes_before_its_first_step_on_every_gpu(
    fused: bool, tmp_path: Path
) -> None:
    """Ranks on GPUs 0 to 3 as there are (NCCL with 4 GPUs, gloo on fewer), collectives
    checked for matching order and shapes across ranks (``TORCH_DISTRIBUTED_DEBUG=DETAIL``)."""
    ranks = run_ranks(
        4,
        _resumed_before_the_first_step,
        str(tmp_path),
        fused,
        timeout=300,
        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    )
    assert {seen["device"] for seen in ranks} == _used_gpus(4)
    for seen in ranks:
        assert seen["misplaced"] == []
        torch.testing.assert_close(seen["resumed"], seen["continued"], rtol=1e-3, atol=1e-4)


def _objects_between_gpus() -> dict[str, Any]:
    """Rank 1 (on GPU 1) sends rank 0 a tensor and a parameter on its GPU; all gather one."""
    smp.init({"pipeline_parallel_degree": 2})
    mine = torch.full((2,), float(smp.rank()), device="cuda")
    gathered = smp.allgather(mine, smp.WORLD)
    got: dict[str, Any] = {}
    if smp.rank() == 1:
        smp.send({"tensor": mine, "param": nn.Parameter(mine.clone())}, 0, smp.RankType.WORLD_RANK)
    else:
        received = smp.recv_from(1, smp.RankType.WORLD_RANK)
        got = {k: (str(v.device), type(v).__name__, v.tolist()) for k, v in received.items()}
    return {
        "device": str(state.current().device),
        "gathered": [(str(t.device), t.tolist()) for t in gathered],
        "got": got,
    }


def test_gpu_tensors_in_objects_land_on_the_receivers_gpu() -> None:
    ranks = run_ranks(2, _objects_between_gpus, timeout=120)
    for rank, seen in enumerate(ranks):
        gpu = f"cuda:{rank % torch.cuda.device_count()}"
        assert seen["device"] == gpu
        assert seen["gathered"] == [(gpu, [0.0, 0.0]), (gpu, [1.0, 1.0])]
    assert ranks[0]["got"] == {
        "tensor": ("cuda:0", "Tensor", [1.0, 1.0]),
        "param": ("cuda:0", "Parameter", [1.0, 1.0]),
    }


LAYER = 2048
"""A layer's weight is 16 MiB."""


def _cache_after_profiling() -> dict[str, int]:
    """pp=2 on one GPU, one layer per rank, rank 0 profiling both on its GPU first."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": True})
    module = nn.Sequential(nn.Linear(LAYER, LAYER), nn.Linear(LAYER, LAYER))
    smp.set_partition(module[0], 0)
    smp.set_partition(module[1], 1)
    model = smp.DistributedModel(module)  # trace_device="gpu"
    sum_step()(model, torch.ones(4, LAYER, device="cuda"))
    allocated = torch.cuda.memory_allocated()
    cached = torch.cuda.memory_reserved() - allocated
    # cuBLAS's workspaces (one per thread and stream that multiplied, 32 MiB each on Hopper)
    # are allocated, not the model's: freed, what stays allocated is the model's.
    torch._C._cuda_clearCublasWorkspaces()
    return {"allocated": torch.cuda.memory_allocated(), "cached": cached}


def test_rank_zero_caches_nothing_of_the_model_it_profiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Profiling had both layers and their gradients on rank 0's GPU; after the first step
    rank 0 holds one layer and its gradient (and cuBLAS's workspaces), and less than a layer's
    worth cached besides."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())
    first, _ = run_ranks(2, _cache_after_profiling, timeout=120)
    layer_bytes = LAYER * LAYER * 4
    assert first["allocated"] < 3 * layer_bytes and first["cached"] < layer_bytes

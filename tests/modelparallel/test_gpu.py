"""The pipeline on CUDA, run where GPUs are (skipped elsewhere): two ranks on one GPU.

A host that runs more processes than it has GPUs gets a gloo world from ``smp.init``, each rank
computing on a shared GPU, with the pipeline's tensors staged through host memory. The script
is SMP's usual one: the model made on the CPU, the batches moved to the GPU in the loop (or
left on the CPU, which the step moves). It must train like one process on that GPU running the
same microbatches, whichever device rank 0 profiles on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import dtrain.modelparallel as smp
from dtrain.modelparallel import state
from tests.modelparallel.equivalence import CASES, LR, Trained, case_pipeline
from tests.modelparallel.harness import first_visible_gpu, run_ranks

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
    profile = model._profile
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

"""The pipeline runtime through the SMP API on 2 ranks: errors, step outputs, the partition plan,
the timeline, and checkpoints of a real partitioned model (partial, full, into another layout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.errors import ConfigError
from dtrain.modelparallel.api.partitioning import trace_device_of
from dtrain.modelparallel.errors import (
    ModelParallelError,
    MultipleDistributedModelError,
    NotInStepError,
    PartitionError,
    StepFailedError,
)
from dtrain.modelparallel.scheduling.check import check
from dtrain.modelparallel.scheduling.planner import build_schedule
from dtrain.modelparallel.scheduling.schedule import Schedule, recorded_schedule
from tests.modelparallel.harness import run_ranks, single_process, train_steps
from tests.modelparallel.models import GroupedNet

CONFIG = {
    "pipeline_parallel_degree": 2,
    "microbatches": 2,
    "auto_partition": False,
    "default_partition": 0,
}


def _images(batch: int, seed: int = 0) -> Tensor:
    return torch.randn(batch, 1, 12, 12, generator=torch.Generator().manual_seed(seed))


def _errors_and_outputs() -> dict[str, Any]:
    """Each misuse on a live 2-rank pipeline: what was raised (type, message)."""
    seen: dict[str, Any] = {}

    def expect(key: str, errors: tuple[type[BaseException], ...], call: Any) -> None:
        try:
            call()
        except errors as exc:
            seen[key] = (type(exc).__name__, str(exc))
        else:
            seen[key] = None

    smp.init(CONFIG)
    module = GroupedNet(seed=0)
    expect("partition_range", (PartitionError,), lambda: smp.set_partition(module.group1, 2))
    smp.set_partition(module.group2, 1)
    model = smp.DistributedModel(module)
    second = nn.Linear(2, 2)
    expect("second_model", (MultipleDistributedModelError,), lambda: smp.DistributedModel(second))
    stranger = nn.Linear(2, 2)
    expect(
        "foreign_optimizer",
        (ModelParallelError,),
        lambda: smp.DistributedOptimizer(torch.optim.SGD(stranger.parameters(), lr=0.1)),
    )
    expect("outside_step_before", (NotInStepError,), lambda: model(_images(2)))

    @smp.step
    def forward(model: smp.DistributedModel, x: Tensor, tag: str) -> Any:
        out = model(x)
        return {"log_probs": out, "tag": tag, "pair": (out.sum(), out.shape[0])}

    expect(
        "indivisible",
        (ModelParallelError,),
        lambda: forward(model, _images(3), "x"),
    )
    result = forward(model, _images(4), "t")  # the pipeline still works after a failed step
    seen["outputs"] = {
        "concat": tuple(result["log_probs"].concat().shape),
        "stack": tuple(result["log_probs"].stack().shape),
        "microbatches": len(result["log_probs"].outputs),
        "tag": result["tag"],
        "pair_sum_is_output": isinstance(result["pair"][0], smp.StepOutput),
        "pair_count": result["pair"][1],
        "requires_grad": result["log_probs"].outputs[0].requires_grad,
    }
    expect("outside_step_after", (NotInStepError,), lambda: model(_images(2)))
    expect("set_partition_late", (PartitionError,), lambda: smp.set_partition(module.group1, 1))
    seen["plan_owner_group2"] = model.partition_plan().owner("group2")
    seen["local"] = sorted(name for name, _ in model.local_named_parameters())
    local = set(seen["local"])
    seen["others_freed"] = all(
        p.numel() == 0 for name, p in module.named_parameters() if name not in local
    )
    return seen


def test_misuse_is_explained_and_outputs_are_assembled() -> None:
    leader, other = run_ranks(2, _errors_and_outputs, timeout=120)
    assert "partition 2 does not exist; allowed: 0 to 1" in leader["partition_range"][1]
    assert "only one smp.DistributedModel" in leader["second_model"][1]
    assert "not in the DistributedModel" in leader["foreign_optimizer"][1]
    assert "@smp.step" in leader["outside_step_before"][1]
    assert leader["indivisible"][0] == "MicrobatchSplitError"
    assert "batch size 3" in leader["indivisible"][1]
    assert "microbatches=2" in leader["indivisible"][1]
    assert other["indivisible"][0] == StepFailedError.__name__
    assert "raised on rank 0" in other["indivisible"][1]
    for seen in (leader, other):
        assert seen["outputs"] == {
            "concat": (4, 10),
            "stack": (2, 2, 10),
            "microbatches": 2,
            "tag": ["t", "t"],
            "pair_sum_is_output": True,
            "pair_count": [2, 2],
            "requires_grad": False,
        }
        assert seen["outside_step_after"] is not None
        assert seen["set_partition_late"] is not None
        assert seen["plan_owner_group2"] == 1
    assert all(name.startswith("group1.") for name in leader["local"])
    assert all(name.startswith("group2.") for name in other["local"])
    assert leader["others_freed"] and other["others_freed"]


def test_trace_device_is_cpu_or_gpu() -> None:
    with single_process():
        for value, named in (
            ("cuda", r"DistributedModel\.trace_device: got 'cuda'; allowed: \"cpu\" or \"gpu\"$"),
            ("cpus", r"got 'cpus'; allowed: \"cpu\" or \"gpu\" \(did you mean 'cpu'\?\)"),
        ):
            with pytest.raises(ConfigError, match=named):
                smp.DistributedModel(nn.Linear(2, 2), trace_device=value)
        smp.DistributedModel(nn.Linear(2, 2), trace_device="cpu")  # the refused ones were not kept
    gpu, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert trace_device_of("gpu", gpu) == gpu
    assert trace_device_of("cpu", gpu) == cpu
    assert trace_device_of("gpu", cpu) == cpu  # a rank without a GPU profiles on the CPU
    with pytest.warns(UserWarning, match="trace_device='cpu' profiles on cuda:1 with tensor_par"):
        assert trace_device_of("cpu", gpu, tp_size=2) == gpu  # NCCL's collectives need the GPU
    assert trace_device_of("cpu", cpu, tp_size=2) == cpu


def test_pipeline_degree_must_divide_the_world() -> None:
    with (
        pytest.raises(ConfigError, match="pipeline_parallel_degree"),
        single_process({"pipeline_parallel_degree": 2}),
    ):
        pass


# --- checkpoints and timeline ------------------------------------------------------------------


def _labels(batch: int, seed: int) -> Tensor:
    return torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(seed))


def _train(model: smp.DistributedModel, optimizer: Any, steps: range) -> list[float]:
    batches = ((_images(4, index), _labels(4, index)) for index in steps)
    return train_steps(model, optimizer, batches, F.nll_loss)


def _pipeline(split: str, seed: int) -> tuple[smp.DistributedModel, Any]:
    module = GroupedNet(seed=seed)
    smp.set_partition(module.get_submodule(split), 1)
    model = smp.DistributedModel(module)
    return model, smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))


def _save_then_resume(folder: str) -> dict[str, Any]:
    dist.init_process_group("gloo")
    smp.init(CONFIG)
    model, optimizer = _pipeline("group2", seed=0)
    _train(model, optimizer, range(3))
    model.export_timeline(f"{folder}/timeline.json")
    smp.save_checkpoint(folder, "step3", partial=True, model=model, optimizer=optimizer)
    smp.save_checkpoint(folder, "full3", partial=False, model=model)
    full = model.state_dict()
    optimizer_full, optimizer_local = optimizer.state_dict(), optimizer.local_state_dict()
    continued = _train(model, optimizer, range(3, 5))
    smp.shutdown()

    smp.init(CONFIG)  # a fresh model (other seed) resumes from the partial checkpoint
    model, optimizer = _pipeline("group2", seed=7)
    smp.resume_from_checkpoint(folder, tag="step3", partial=True)
    resumed = _train(model, optimizer, range(3, 5))
    smp.shutdown()

    smp.init(CONFIG)  # another split loads the full checkpoint
    model, optimizer = _pipeline("group1.conv2", seed=7)
    smp.resume_from_checkpoint(folder, tag="full3", partial=False)
    _train(model, optimizer, range(1))  # partitions, then compare the loaded weights
    reloaded = model.state_dict()
    smp.shutdown()

    # Another partition count: no pipeline, two data-parallel replicas.
    smp.init({"pipeline_parallel_degree": 1, "microbatches": 2, "ddp": True})
    model = smp.DistributedModel(GroupedNet(seed=7))
    smp.resume_from_checkpoint(folder, tag="full3", partial=False)
    unpipelined = model.state_dict()
    smp.shutdown()
    # Rank 0 hosts the world's store: ending its world before rank 1 has made its pipeline
    # group of one from the store (the last group smp.init makes, with no collective after it
    # here) reset rank 1's connection, as it did under load.
    dist.barrier()
    dist.destroy_process_group()
    return {
        "continued": continued,
        "resumed": resumed,
        "full": full,
        "reloaded_keys": list(reloaded),
        "unpipelined": unpipelined,
        "optimizer_full": optimizer_full,
        "optimizer_local": optimizer_local,
    }


def test_checkpoints_round_trip_and_change_layout(tmp_path: Path) -> None:
    leader, other = run_ranks(2, _save_then_resume, str(tmp_path), timeout=180)
    assert leader["resumed"] == pytest.approx(leader["continued"], rel=1e-6)
    assert other["resumed"] == leader["resumed"]
    assert leader["reloaded_keys"] == list(leader["full"])
    for name, value in leader["full"].items():
        assert torch.equal(leader["unpipelined"][name], value), name

    # The full checkpoint is a plain state dict: it loads into an unpartitioned model.
    plain = GroupedNet(seed=3)
    plain.load_state_dict(torch.load(tmp_path / "full3", weights_only=False))
    for name, value in plain.state_dict().items():
        assert torch.equal(value, leader["full"][name]), name

    # The full optimizer state is both stages' states, by parameter name; each rank holds its own.
    full_state = leader["optimizer_full"]["state"]
    assert set(full_state) == {name for name, _ in GroupedNet().named_parameters()}
    assert other["optimizer_full"]["state"].keys() == full_state.keys()
    local = [set(r["optimizer_local"]["state"]) for r in (leader, other)]
    assert local[0] and local[1] and not local[0] & local[1]
    assert local[0] | local[1] == set(full_state)
    assert all(name.startswith("group2.") for name in local[1])
    for name, value in full_state.items():
        assert value["exp_avg"].shape == leader["full"][name].shape, name

    trace = json.loads((tmp_path / "timeline.json").read_text())
    ranks = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    kinds = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ranks == {0, 1}
    assert kinds - {"SEND", "RECV", "WAIT"} == {"F", "B", "I", "W"}  # the last backward split


def _timelines(pipeline: str, microbatches: int, active: int) -> list[Any]:
    smp.init({**CONFIG, "pipeline": pipeline, "microbatches": microbatches,
              "active_microbatches": active})  # fmt: skip
    model, optimizer = _pipeline("group2", seed=0)
    _train(model, optimizer, range(3))
    return model.timeline()


def _recorded(pipeline: str, microbatches: int, active: int) -> Schedule:
    events = [e for rank in run_ranks(2, _timelines, pipeline, microbatches, active, timeout=120)
              for e in rank]  # fmt: skip
    return recorded_schedule(events, pipeline, 2, microbatches, active)


def test_simple_pipeline_keeps_its_rules() -> None:
    """Every forward before any backward on each rank, the plan's work and no other, consistent
    across ranks. The order among ready microbatches is the runtime's (it never idles waiting
    for a particular one), so it is checked by the rules, not against the plan's order."""
    recorded = _recorded("simple", 4, 4)
    check(recorded)
    plan = build_schedule("simple", 2, 4, 4)
    for rank in range(2):
        assert sorted(map(str, recorded.actions[rank])) == sorted(map(str, plan.actions[rank]))


def test_interleaved_pipeline_keeps_its_rules_and_its_bound() -> None:
    """Backward first within ``active_microbatches``: the real order passes the schedule checker
    (every forward before its backward, at most 2 in flight, consistent across the ranks)."""
    recorded = _recorded("interleaved", 4, 2)
    check(recorded)
    leader = recorded.compute_actions(0)
    assert [a.kind for a in leader[:3]] == ["F", "F", "B"], str(recorded)  # no third forward

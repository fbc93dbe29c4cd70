"""Memory per partition: each kind's arithmetic, the microbatches a schedule holds, the search
for a layout that fits a per-rank limit, and the job's check against its GPU (a fake figure)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from dtrain.config.modelparallel import validate_mp_parameters
from dtrain.errors import ConfigError
from dtrain.modelparallel.errors import MemoryLimitError, PartitionError
from dtrain.modelparallel.options import RuntimeOptions
from dtrain.modelparallel.plan import fit
from dtrain.modelparallel.plan.memory import (
    MemorySettings,
    held_microbatches,
    optimizer_kind,
    parse_size,
)
from dtrain.modelparallel.plan.partition import PartitionPlan, costed_plan
from dtrain.modelparallel.plan.profile import ModelProfile, ModuleStats, ProfiledCall
from dtrain.modelparallel.plan.solver import auto_plan
from dtrain.modelparallel.scheduling.schedule import simulate

KIB = 1024


def layers(
    count: int, param_count: int, activation_bytes: int = 0, buffer_bytes: int = 0
) -> ModelProfile:
    """A root calling ``m0 .. m{count-1}`` in turn, each with fp32 parameters; no times (as a
    profile of a model on the meta device has none)."""
    modules = {"": ModuleStats(name="", type="Root", parent=None, calls=1, order=0)}
    calls = [ProfiledCall(0, "", -1)]
    for i in range(count):
        name = f"m{i}"
        modules[""].children.append(name)
        modules[name] = ModuleStats(
            name=name,
            type="Layer",
            parent="",
            calls=1,
            order=i + 1,
            param_count=param_count,
            param_bytes=4 * param_count,
            buffer_bytes=buffer_bytes,
            activation_bytes=activation_bytes,
        )
        calls.append(ProfiledCall(i + 1, name, 0, activation_bytes, activation_bytes))
    return ModelProfile(modules=modules, calls=calls)


def two_parts(settings: MemorySettings) -> PartitionPlan:
    """``m0`` (100 parameters, 40 bytes of buffers, 1000 of activations) on partition 0,
    ``m1`` (200 parameters, 2000 of activations) on partition 1."""
    profile = layers(2, 100, activation_bytes=1000, buffer_bytes=40)
    profile.modules["m1"].param_count = 200
    profile.modules["m1"].param_bytes = 800
    profile.modules["m1"].buffer_bytes = 0
    profile.modules["m1"].activation_bytes = 2000
    owners = {"": 0, "m0": 0, "m1": 1}
    return costed_plan(profile, 2, owners, memory_weight=0.5).with_memory(settings)


@pytest.mark.parametrize(
    ("optimizer", "states"), [("adam", 2), ("adamw", 2), ("sgd-momentum", 1), ("sgd", 0)]
)
def test_each_kind_of_memory_in_full_precision(optimizer: str, states: int) -> None:
    first, second = two_parts(MemorySettings(optimizer=optimizer)).peak_memory
    assert (first.params, first.grads, first.master) == (400, 400, 0)
    assert first.optimizer == states * 400
    assert (first.buffers, first.activations, first.held_microbatches) == (40, 1000, 1)
    assert first.total == 400 + 400 + states * 400 + 40 + 1000
    assert (second.params, second.optimizer, second.activations) == (800, states * 800, 2000)


@pytest.mark.parametrize("half", ["fp16", "bf16"])
def test_half_precision_parameters_with_fp32_masters(half: str) -> None:
    first, _ = two_parts(MemorySettings(optimizer="adam", half_precision=half)).peak_memory
    # 100 parameters: 2 bytes each, a 4-byte master with its fp32 gradient, Adam's two states.
    assert (first.params, first.grads, first.master, first.optimizer) == (200, 400, 400, 800)
    assert first.total == 200 + 400 + 400 + 800 + 40 + 1000


def test_activations_scale_to_the_microbatch_size() -> None:
    """Profiled as one of 4 microbatches, planned with 8: each microbatch is half the size."""
    settings = MemorySettings(pipeline="simple", microbatches=8, active_microbatches=8)
    first, _ = two_parts(settings).peak_memory
    assert (first.held_microbatches, first.activations) == (8, 8 * 1000)
    halved = MemorySettings(
        pipeline="simple", microbatches=8, active_microbatches=8, profiled_microbatches=4
    )
    first, _ = two_parts(halved).peak_memory
    assert (first.held_microbatches, first.activations) == (8, 8 * 500)


def test_microbatches_held_by_each_schedule() -> None:
    """2 stages x 8 microbatches. ``simple`` holds every microbatch on every stage;
    ``interleaved`` with 4 active: the first stage 4 (its own backward comes last), the second
    2 when a split backward keeps a microbatch's activations until its weight half (as in the
    schedule the docs print), else 1."""
    simple = MemorySettings(pipeline="simple", microbatches=8, active_microbatches=8)
    assert held_microbatches(simple, 2) == [8, 8]
    interleaved = MemorySettings(pipeline="interleaved", microbatches=8, active_microbatches=4)
    assert held_microbatches(interleaved, 2) == [4, 2]
    whole = MemorySettings(
        pipeline="interleaved", microbatches=8, active_microbatches=4, split_backward=False
    )
    assert held_microbatches(whole, 2) == [4, 1]
    # SMP's rule: simple with fewer in flight than microbatches runs as interleaved.
    bounded = MemorySettings(pipeline="simple", microbatches=8, active_microbatches=4)
    assert held_microbatches(bounded, 2) == [4, 2]
    assert "interleaved pipeline (simple asked" in bounded.describe(2)


def test_the_plan_shows_and_keeps_its_memory(tmp_path: Any) -> None:
    plan = two_parts(MemorySettings(optimizer="sgd-momentum", half_precision="bf16"))
    table = plan.table()
    assert "peak memory  params  grads  optimizer  buffers     activations    total" in table
    assert "partition 0   200 B  400 B      800 B     40 B   1000 B (1 mb)  2.4 KiB" in table
    assert "sgd-momentum (1 state tensor per parameter), bf16 parameters with fp32" in table
    assert "optimizer = state + fp32 masters" in table
    assert "partition 1\\n0.002 ms, cost 0.331\\npeak memory 4.7 KiB" in plan.to_dot()
    again = PartitionPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert again.stages[1].peak_memory is not None and again.stages[1].param_count == 200


def test_a_plan_without_memory_says_how_to_get_it() -> None:
    plan = costed_plan(layers(2, 10), 2, {"": 0, "m0": 0, "m1": 1}, memory_weight=0.5)
    assert "peak memory" not in plan.table()
    assert PartitionPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(PartitionError, match=r"plan.with_memory\(MemorySettings"):
        plan.peak_memory  # noqa: B018


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1073741824", 1 << 30),
        ("8GiB", 8 << 30),
        ("512MiB", 512 << 20),
        ("8GB", 8 * 10**9),
        ("8 gb", 8 * 10**9),
        ("1.5KiB", 1536),
        ("100B", 100),
        ("2TiB", 2 << 40),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size("--memory-per-rank", text) == size


@pytest.mark.parametrize("text", ["", "8G", "eight GiB", "-1GiB", "0", "0.1B", "8 GiBs", "1e9"])
def test_bad_sizes_name_the_forms_allowed(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^--memory-per-rank: got .*allowed: .*8GiB, 512MiB"):
        parse_size("--memory-per-rank", text)


def test_bad_settings_are_named() -> None:
    with pytest.raises(ConfigError, match=r"optimizer: got 'adagrad'; allowed: adam, adamw"):
        MemorySettings(optimizer="adagrad")
    with pytest.raises(ConfigError, match=r"half_precision: got 'fp8'"):
        MemorySettings(half_precision="fp8")
    with pytest.raises(ConfigError, match=r"microbatches: got 0; allowed: an integer >= 1"):
        MemorySettings(microbatches=0)


def test_torch_optimizers_by_their_state() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    assert optimizer_kind(torch.optim.Adam(params)) == "adam"
    assert optimizer_kind(torch.optim.AdamW(params)) == "adamw"
    assert optimizer_kind(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == "sgd-momentum"
    assert optimizer_kind(torch.optim.SGD(params, lr=0.1)) == "sgd"
    # Unknown state counts as none: an estimate from below never refuses a job that fits.
    assert optimizer_kind(torch.optim.Adagrad(params)) == "sgd"
    assert optimizer_kind(None) == "sgd"


# --- the search for a layout that fits --------------------------------------------------------

PARAMS = 1000
"""Per layer: 4000 bytes of fp32 parameters, 16000 with gradients and Adam's state."""


def test_more_partitions_when_the_parameters_do_not_fit() -> None:
    """8 layers of 16000 bytes with Adam: 64000 per partition at pp=2, 48000 at pp=3, 32000 at
    pp=4; with a limit of 40000 only more partitions help (activations are tiny)."""
    profile = layers(8, PARAMS, activation_bytes=8)
    settings = MemorySettings(microbatches=4)
    plan = auto_plan(profile, 2, memory_weight=0.2).with_memory(settings)
    assert [peak.total for peak in plan.peak_memory] == [64128, 64064]
    with pytest.raises(MemoryLimitError) as error:
        fit.check_memory(plan, profile, 40_000, memory_weight=0.2)
    message = str(error.value)
    assert message.startswith(
        "partition 0 of 2 needs 62.6 KiB at its peak, more than the 39.1 KiB allowed per rank: "
        "params 15.6 KiB, grads 15.6 KiB, optimizer 31.2 KiB, buffers 0 B, activations 128 B "
        "(4 microbatches held); also over: partition 1 (62.6 KiB) (assuming adam"
    )
    assert (
        "A layout that fits: partitions 2 -> 4 (interleaved pipeline, 4 microbatches, at most 4 "
        "in flight; largest partition 31.3 KiB)"
    ) in message
    found = fit.fit_layout(profile, 40_000, settings, partitions=2, memory_weight=0.2)
    assert found.fits and found.plan.partitions == 4 and found.changes == ["partitions 2 -> 4"]


def test_more_microbatches_when_the_activations_do_not_fit() -> None:
    """Activations dominate: ``simple`` with 4 microbatches holds all 4 on both stages; as
    ``interleaved`` the first stage still holds 4; 8 microbatches of half the size, of which
    at most 4 in flight, halve the first stage's activations without another rank."""
    profile = layers(2, 10, activation_bytes=10_000)
    settings = MemorySettings(pipeline="simple", microbatches=4)
    plan = auto_plan(profile, 2, memory_weight=0.2).with_memory(settings)
    assert [peak.held_microbatches for peak in plan.peak_memory] == [4, 4]
    found = fit.fit_layout(profile, 30_000, settings, partitions=2, memory_weight=0.2)
    assert found.fits and found.changes == ["microbatches 4 -> 8"]
    assert found.plan.partitions == 2
    assert max(peak.total for peak in found.plan.peak_memory) <= 30_000
    with pytest.raises(MemoryLimitError) as error:
        fit.check_memory(plan, profile, 30_000, memory_weight=0.2)
    assert (
        "A layout that fits: microbatches 4 -> 8 (interleaved pipeline (simple asked; SMP runs "
        "it so with fewer in flight than all), 8 microbatches, at most 4 in flight; largest "
        "partition 19.7 KiB)"
    ) in str(error.value)
    # Only counts that divide the batch: 6 samples allow 6 microbatches, not 8.
    found = fit.fit_layout(
        profile, 30_000, settings, partitions=2, memory_weight=0.2, batch_size=12
    )
    assert found.fits and found.changes == ["microbatches 4 -> 6"]


def test_a_model_that_fits_nowhere_says_by_how_much() -> None:
    profile = layers(8, PARAMS)
    plan = auto_plan(profile, 2, memory_weight=0.2).with_memory(MemorySettings())
    with pytest.raises(MemoryLimitError) as error:
        fit.check_memory(plan, profile, 10_000, memory_weight=0.2, max_partitions=4)
    assert (
        "No layout up to 4 partitions and 64 microbatches fits: the closest (partitions 2 -> 4) "
        "needs 31.2 KiB on partition 0, 21.5 KiB over the limit"
    ) in str(error.value)
    with pytest.raises(MemoryLimitError) as error:
        fit.check_memory(plan, profile, 10_000, memory_weight=0.2, max_partitions=20)
    assert "No layout up to 9 partitions (the model has no more parts to place)" in str(error.value)


# --- the job's check against its GPU ----------------------------------------------------------


def job_state(device: str, local_size: int = 2, **parameters: Any) -> Any:
    config = validate_mp_parameters({"partitions": 2, **parameters})
    return SimpleNamespace(
        config=config, device=torch.device(device), options=RuntimeOptions(), local_size=local_size
    )


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The host's GPUs (two) of 80 GiB, whose free memory and cuBLAS workspace the test sets."""
    figures = {"free": 0, "gpus": 2, "workspace": 0}
    monkeypatch.setattr(fit, "available_device_memory", lambda device, module: figures["free"])
    monkeypatch.setattr(fit, "cublas_workspace_bytes", lambda device: figures["workspace"])
    monkeypatch.setattr(fit.state, "visible_gpus", lambda: figures["gpus"])
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(total_memory=80 << 30),
    )
    return figures


def test_a_job_on_a_gpu_that_is_too_small_fails_before_its_first_step(
    fake_gpu: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = layers(8, PARAMS, activation_bytes=8)
    plan = auto_plan(profile, 2, memory_weight=0.2)
    adam = torch.optim.Adam([nn.Parameter(torch.zeros(1))])
    monkeypatch.setattr(fit.state, "current_optimizer", lambda: adam)
    st = job_state("cuda:0", microbatches=2)
    fake_gpu["free"] = 40_000
    with pytest.raises(MemoryLimitError) as error:
        fit.check_device_memory(plan, profile, st, nn.Linear(1, 1), {}, ())
    message = str(error.value)
    assert (
        "more than the 39.1 KiB left on GPU cuda:0 (of 80.0 GiB; its free memory, less" in message
    )
    assert "A layout that fits: partitions 2 -> 4" in message
    fake_gpu["free"] = 1 << 30
    checked = fit.check_device_memory(plan, profile, st, nn.Linear(1, 1), {}, ())
    assert checked.memory_settings == MemorySettings(
        optimizer="adam", microbatches=2, active_microbatches=2
    )
    # The CPU has no such figure: the plan comes back with its memory, unchecked.
    fake_gpu["free"] = 0
    monkeypatch.setattr(fit.state, "current_optimizer", lambda: None)
    on_cpu = fit.check_device_memory(plan, profile, job_state("cpu"), nn.Linear(1, 1), {}, ())
    assert on_cpu.peak_memory[0].optimizer == 0  # no optimizer registered: none counted


def test_ranks_sharing_a_gpu_share_its_memory_and_each_thread_keeps_a_cublas_workspace(
    fake_gpu: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """pp=2 on two GPUs, then on one: a partition may take the free memory, then half of it,
    less a cuBLAS workspace for the main thread and each microbatch in flight (interleaved, 2
    partitions: 4)."""
    profile = layers(8, PARAMS, activation_bytes=8)
    plan = auto_plan(profile, 2, memory_weight=0.2).with_memory(MemorySettings(microbatches=8))
    st = job_state("cuda:0", local_size=2, microbatches=8)
    fake_gpu.update(free=10 << 30, workspace=32 << 20)
    assert fit.device_limit(plan, st, nn.Linear(1, 1)) == (
        (10 << 30) - 5 * (32 << 20),
        "left on GPU cuda:0 (of 80.0 GiB; its free memory, less 160.0 MiB of cuBLAS workspaces "
        "for 5 threads)",
    )
    fake_gpu["gpus"] = 1
    limit, name = fit.device_limit(plan, st, nn.Linear(1, 1))
    assert limit == (5 << 30) - 5 * (32 << 20)
    assert "its free memory over the 2 ranks that share it, less 160.0 MiB" in name
    fake_gpu["workspace"] = 8 << 30  # more than a share: nothing left, not a negative limit
    assert fit.device_limit(plan, st, nn.Linear(1, 1))[0] == 0


def test_a_cublas_workspace_is_torchs_figure_or_its_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch._C, "_cuda_getCublasWorkspaceSize", raising=False)
    hopper = SimpleNamespace(major=9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: hopper)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert fit.cublas_workspace_bytes(torch.device("cuda:0")) == 32 << 20
    hopper.major = 8
    assert fit.cublas_workspace_bytes(torch.device("cuda:0")) == (4096 * 2 + 16 * 8) << 10
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert fit.cublas_workspace_bytes(torch.device("cuda:0")) == 32 << 20
    monkeypatch.setattr(torch._C, "_cuda_getCublasWorkspaceSize", lambda: 5, raising=False)
    assert fit.cublas_workspace_bytes(torch.device("cuda:0")) == 5


def test_free_memory_counts_the_cache_and_the_model_already_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 << 30)
    module = nn.Linear(4, 4)  # on the CPU, so none of it is on the GPU
    assert fit.available_device_memory(torch.device("cuda:0"), module) == (5 + 2) << 30
    assert fit.available_device_memory(torch.device("cpu"), module) == (7 << 30) + 80


# --- a job ------------------------------------------------------------------------------------


def _job_plan() -> dict[str, Any]:
    import torch.nn.functional as F

    import dtrain.modelparallel as smp
    from tests.modelparallel.harness import train_steps
    from tests.modelparallel.models import GroupedNet

    smp.init({"partitions": 2, "microbatches": 4, "active_microbatches": 2})
    model = smp.DistributedModel(GroupedNet(seed=0))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(4, 1, 12, 12, generator=generator)
    labels = torch.randint(0, 10, (4,), generator=generator)
    train_steps(model, optimizer, [(images, labels)], F.nll_loss)
    plan = model.partition_plan()
    return {
        "plan": plan.to_dict(),
        "held": list(simulate(model.pipeline_schedule()).peak_held),
    }


def test_a_job_plan_carries_its_memory() -> None:
    """On the CPU a job's plan comes with its memory (nothing to check it against): the
    settings are the job's, the microbatches held those of the schedule it runs."""
    from tests.modelparallel.harness import run_ranks

    leader, other = run_ranks(2, _job_plan, timeout=120)
    assert leader["plan"] == other["plan"]
    plan = PartitionPlan.from_dict(leader["plan"])
    assert plan.memory_settings == MemorySettings(
        optimizer="adamw", microbatches=4, active_microbatches=2
    )
    assert [peak.held_microbatches for peak in plan.peak_memory] == leader["held"]
    for stage, peak in zip(plan.stages, plan.peak_memory, strict=True):
        assert peak.params == stage.param_bytes > 0 and peak.optimizer == 2 * stage.param_bytes

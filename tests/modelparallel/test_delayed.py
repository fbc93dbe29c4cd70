"""Models created without memory (``smp.delay_param_initialization``, ``smp.model_creation``).

In one process: every parameter and buffer made later has exactly the eager value under the same
seed, whatever part is made first, for our models and Hugging Face's (their ``_init_weights``,
tied embeddings), and the random stream after the block is the eager one. Pipelined: a delayed
model trains like the eagerly created one in one process, each rank making only its own share;
rank 0 plans from shapes and operation counts without holding the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel import deferred
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.plan.profile import on_meta
from tests.modelparallel import hf_cases
from tests.modelparallel.equivalence import CASES, case_pipeline, init_smp, reference
from tests.modelparallel.harness import run_ranks, single_process
from tests.modelparallel.models import GroupedNet, ResidualTransformerLM, SharedLayerLM, seeded
from tests.modelparallel.test_equivalence import assert_equivalent

STEPS = 3


def _delayed(build: Any) -> nn.Module:
    with smp.delay_param_initialization():
        return seeded(0, build)


def _tensors(module: nn.Module) -> list[Tensor]:
    return list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())


def _assert_made_like_eager(build: Any, where: str = "cpu") -> None:
    """Made on ``where`` (the default device while the model is created): its random
    initialisers draw from that device's generator, eagerly and recorded alike."""
    device = torch.device(where)
    with device:
        eager = seeded(0, build)
        lazy = _delayed(build)
    tensors = _tensors(lazy)
    assert tensors and all(t.is_meta for t in tensors)
    # Any order, any share: the second half first, then the rest.
    deferred.materialize(tensors[len(tensors) // 2 :], device)
    assert sum(t.is_meta for t in tensors) == len(tensors) // 2
    deferred.materialize(tensors, device)
    expected = eager.state_dict()
    for name, value in lazy.state_dict().items():
        assert value.dtype == expected[name].dtype, name
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("build", [ResidualTransformerLM, GroupedNet, SharedLayerLM])
def test_our_models_are_made_with_their_eager_values(build: Any) -> None:
    _assert_made_like_eager(build)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [ResidualTransformerLM, GroupedNet])
def test_models_created_on_the_gpu_are_made_with_their_eager_values(build: Any) -> None:
    _assert_made_like_eager(build, "cuda:0")


@pytest.mark.parametrize("case", ["gpt2", "llama", "bert"])
def test_hugging_face_models_are_made_with_their_eager_values(case: str) -> None:
    pytest.importorskip("transformers")
    _assert_made_like_eager(hf_cases.CASES[case].build)


def test_tied_weights_stay_one_parameter() -> None:
    pytest.importorskip("transformers")
    lazy = _delayed(hf_cases.CASES["gpt2"].build)
    head = lazy.get_submodule("lm_head")
    deferred.materialize([head.weight], torch.device("cpu"))
    assert head.weight is lazy.get_submodule("transformer.wte").weight
    assert not head.weight.is_meta


def test_the_random_stream_after_the_block_is_the_eager_one() -> None:
    torch.manual_seed(3)
    ResidualTransformerLM()
    eager_next = torch.rand(4)
    torch.manual_seed(3)
    with smp.delay_param_initialization():
        ResidualTransformerLM()
    assert torch.equal(torch.rand(4), eager_next)


def test_making_the_model_leaves_the_random_stream_alone() -> None:
    lazy = _delayed(ResidualTransformerLM)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    deferred.materialize(_tensors(lazy), torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected)


class _Derived(nn.Module):
    """Init code that computes one parameter from another, and a buffer from a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, 4))
        self.b = nn.Parameter(self.a.detach() * 2 + torch.tensor([1.0, 2.0, 3.0, 4.0]))
        self.register_buffer("steps", torch.arange(4.0))
        with torch.no_grad():
            self.a[0].zero_()


def test_init_that_reads_other_parameters_is_replayed() -> None:
    _assert_made_like_eager(_Derived)
    lazy = _delayed(_Derived)
    deferred.materialize([lazy.b], torch.device("cpu"))  # b alone: a is made, then dropped
    assert lazy.a.is_meta and torch.equal(lazy.b, seeded(0, _Derived).b)


class _Peeking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        if self.w.sum().item() > 0:
            self.w.data.neg_()


def test_init_that_reads_a_value_fails_naming_the_module() -> None:
    with pytest.raises(ModelParallelError, match=r"_Peeking \(.*test_delayed.py:\d+\) read a"):
        _delayed(_Peeking)


@pytest.mark.parametrize(
    "name, shape, via",
    [
        ("trunc_normal_", (4,), "torch"),  # ViT's class token and positions
        ("orthogonal_", (4, 4), "torch"),
        ("orthogonal_", (4, 4), "deprecated"),
        ("orthogonal_", (4, 4), "transformers"),
        ("dirac_", (4, 4, 3), "torch"),
        ("sparse_", (4, 4), "torch"),
    ],
)
def test_inits_that_skip_meta_tensors_fail_naming_the_module_and_torch_is_as_it_was_after(
    name: str, shape: tuple[int, ...], via: str
) -> None:
    # torch.nn.init returns at once on a meta tensor for these: the tensor would go unrecorded.
    if via == "transformers":  # the table of torch's originals HF's _init_weights calls
        table = pytest.importorskip("transformers.initialization").TORCH_INIT_FUNCTIONS
    else:
        table = vars(nn.init)
    key = name.rstrip("_") if via == "deprecated" else name

    class Skipped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(shape))
            table[key](self.weight)  # looked up when called, as nn.init.orthogonal_(w) is

    before = dict(table), dict(vars(nn.init))
    message = rf"Skipped \(.*\) initialises a tensor with torch.nn.init.{name},"
    with pytest.raises(ModelParallelError, match=message):
        _delayed(Skipped)
    assert (dict(table), dict(vars(nn.init))) == before


def test_a_parameter_replaced_after_the_block_is_refused() -> None:
    lazy = _delayed(GroupedNet)
    lazy.group1.conv1.weight = nn.Parameter(torch.empty(4, 1, 3, 3, device="meta"))
    with pytest.raises(ModelParallelError, match=r"shape \[4, 1, 3, 3\].*after the block"):
        deferred.materialize(_tensors(lazy), torch.device("cpu"))


def test_profiling_a_partly_made_model_on_meta_gives_its_real_parameters_back() -> None:
    """A model made in part (at tp > 1: the split modules, made when wrapped) runs on the meta
    device to be profiled; its real parameters are the same objects, with their values and
    marks, afterwards (a parameter swapped back with the meta twin stayed on meta)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with smp.delay_param_initialization():
        model[1] = nn.Linear(2, 2)
    real = model[0].weight
    real.mark = "kept"  # type: ignore[attr-defined]
    values = real.detach().clone()
    with on_meta(model):
        assert real.is_meta and model[0].weight is real
    assert not real.is_meta and isinstance(real, nn.Parameter) and real.requires_grad
    assert torch.equal(real, values) and real.mark == "kept"  # type: ignore[attr-defined]
    assert model[1].weight.is_meta  # still to be made


def test_model_creation_delays_as_the_job_says_in_its_dtype() -> None:
    with single_process({"delayed_parameter_initialization": True}):
        with smp.model_creation(dtype=torch.bfloat16):
            model = nn.Linear(4, 4)
        assert model.weight.is_meta and model.weight.dtype == torch.bfloat16
        assert torch.get_default_dtype() == torch.float32
        refused = smp.model_creation(dtype="bf16")  # type: ignore[arg-type]
        with pytest.raises(ModelParallelError, match="dtype is 'bf16'; allowed"):
            refused.__enter__()
    with single_process(), smp.model_creation():
        assert not nn.Linear(2, 2).weight.is_meta


# --- pipelined -------------------------------------------------------------------------------


def _train_delayed(case_name: str, pipeline_degree: int) -> dict[str, Any]:
    """Train the case's model created without memory, planned automatically; rank 0 of the
    pipeline returns the losses and full parameters, every rank what it made."""
    dist.init_process_group("gloo")
    init_smp(pipeline_degree, "interleaved", 2, auto=True)
    case = CASES[case_name]
    model, step = case_pipeline(case, auto=True, delayed=True)
    module = model.module
    total = sum(p.numel() for p in module.parameters())
    losses = [step(*case.batch(index)) for index in range(STEPS)]
    made = sum(p.numel() for p in module.parameters() if not p.is_meta)
    local = sum(p.numel() for p in model.local_parameters())
    params = model.state_dict()
    profiled = model.partition_plan().profiled
    smp.shutdown()
    dist.destroy_process_group()
    return {
        "losses": losses,
        "params": params,
        "made": made,
        "local": local,
        "total": total,
        "profiled": profiled,
    }


@pytest.mark.parametrize("pipeline_degree", [2, 4])
def test_a_delayed_model_trains_like_the_eager_one_in_one_process(pipeline_degree: int) -> None:
    """The LM (tied head, a skip across any cut) planned from its meta shapes; no rank made
    more than its own share."""
    expected = reference("lm", STEPS)
    results = run_ranks(pipeline_degree, _train_delayed, "lm", pipeline_degree, timeout=240)
    first = results[0]
    got = type(expected)(first["losses"], first["params"])
    assert_equivalent(got, expected, f"delayed, pp={pipeline_degree}")
    for result in results:
        assert result["profiled"]
        assert result["made"] == result["local"] < result["total"]
    assert sum(result["local"] for result in results) == first["total"]


# --- a model that does not fit a rank --------------------------------------------------------

CAPPED_LM = {"vocab": 256, "dim": 1024, "heads": 4, "layers": 8, "tie_weights": False}


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _train_capped() -> dict[str, int]:
    """Adam on the LM created without memory, pp=4; this rank's peak resident memory above
    what it held before creating the model (the peak is reset there)."""
    dist.init_process_group("gloo")
    init_smp(4, "interleaved", 2, auto=True)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from now
    before = _resident_kib("VmRSS")
    with smp.delay_param_initialization():
        module = ResidualTransformerLM(seed=0, **CAPPED_LM)
    whole = sum(p.numel() for p in module.parameters())
    model = smp.DistributedModel(module)
    # One parameter at a time, as a user short of memory runs Adam: the default (foreach)
    # holds temporaries as large as all of a rank's parameters while it steps.
    adam = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    optimizer = smp.DistributedOptimizer(adam)

    @smp.step
    def train_step(model: smp.DistributedModel, ids: Tensor) -> Tensor:
        loss = model(ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    ids = torch.randint(0, CAPPED_LM["vocab"], (8, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        optimizer.zero_grad()
        train_step(model, ids)
        optimizer.step()
    grown = (_resident_kib("VmHWM") - before) * 1024
    smp.shutdown()
    dist.destroy_process_group()
    return {"grown": grown, "whole_parameters": whole}


def test_a_model_whose_weights_and_adam_state_do_not_fit_a_rank_trains_with_pp4() -> None:
    """The cap: three quarters of the whole model's fp32 weights plus Adam's two moments (12
    bytes a parameter; 1.2 GB for this 101M-parameter LM), which one process could not even
    create and step (it peaks at 1.75 GB); each of 4 ranks stays under it from creating the
    model to the end of its second step: 16 bytes a parameter of its quarter of the model,
    with gradients (0.4 GB), plus the allocator's and the process's own (kernels' buffers,
    threads, gloo), 0.15 to 0.3 GB here."""
    results = run_ranks(4, _train_capped, timeout=240)
    cap = 12 * results[0]["whole_parameters"] * 3 // 4
    grown = [result["grown"] for result in results]
    print(f"peak growth per rank {[g >> 20 for g in grown]} MiB, cap {cap >> 20} MiB")
    assert max(grown) < cap, f"peak growth per rank {grown} bytes, cap {cap}"


def _mlp() -> nn.Module:
    """Drawn from the global generator (our test models seed themselves)."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))


def _made_seeded_apart() -> dict[str, Tensor]:
    dist.init_process_group("gloo")
    init_smp(2, "interleaved", 2, auto=False)
    torch.manual_seed(100 + dist.get_rank())
    with smp.delay_param_initialization():
        module = _mlp()
    smp.set_partition(module[3], 1)
    model = smp.DistributedModel(module)

    @smp.step
    def forward(model: smp.DistributedModel, x: Tensor) -> Tensor:
        return model(x)

    forward(model, torch.ones(2, 8))
    made = model.state_dict()
    smp.shutdown()
    dist.destroy_process_group()
    return made


def test_ranks_seeded_apart_make_rank_zeros_model() -> None:
    """As eager ranks take rank 0's values, delayed ranks replay rank 0's random states."""
    torch.manual_seed(100)
    expected = _mlp().state_dict()
    for made in run_ranks(2, _made_seeded_apart, timeout=120):
        assert made.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(made[name], value), name


def test_hugging_face_models_created_without_memory_train_like_one_process() -> None:
    """GPT-2 (tied head) and Llama, from_config inside the block, planned from the meta model."""
    pytest.importorskip("transformers")
    layouts = [hf_cases.Layout(case, auto=True, delayed=True) for case in ("gpt2", "llama")]
    results = run_ranks(2, hf_cases.train_layouts, layouts, STEPS, timeout=240, env=hf_cases.HF_ENV)
    for layout, got in zip(layouts, results[0], strict=True):
        assert got is not None and got.partitions_used == 2
        assert_equivalent(got, hf_cases.reference(layout.case, STEPS), layout.case)

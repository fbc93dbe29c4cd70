"""Activation checkpointing on any pipeline partition trains like one process without it.

``smp.set_activation_checkpointing`` (modules and ``nn.Sequential`` strategies), SMP's
``patches.checkpoint`` functions and ``torch.utils.checkpoint`` written around a module of
another partition, on pp=2: the same losses and parameters as one process without
checkpointing, and each checkpointed block's forward runs twice per microbatch (the
recomputation in backward) on the rank that owns it. Several setups share one world to keep
the file fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.errors import ConfigError
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import activations
from dtrain.modelparallel.modules.activations import Group, group_runs, set_activation_checkpointing
from dtrain.modelparallel.modules.checkpoint import checkpoint, checkpoint_sequential
from tests.modelparallel.equivalence import init_smp
from tests.modelparallel.harness import first_visible_gpu, run_ranks
from tests.modelparallel.test_equivalence import assert_equivalent

DIM = 8
BATCH = 8
STEPS = 2
LR = 0.1
SPLIT = ("seq.2", "seq.3", "second", "head")
"""On partition 1; the rest (``inp``, ``first``, ``seq`` with its first two blocks) on 0."""
BLOCKS = ("first", "seq.0", "seq.1", "seq.2", "seq.3", "second")


class _Block(nn.Module):
    """Residual MLP, with dropout if asked; counts its forwards (recomputations included)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x + self.fc2(self.drop(F.gelu(self.fc1(x))))


@dataclass(frozen=True)
class Setup:
    marks: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    """``set_activation_checkpointing(module, **kwargs)`` calls: (module name, kwargs)."""
    marks_after_wrapping: bool = False
    """Mark after ``smp.DistributedModel`` (else before)."""
    dropout_in: str = ""
    """The one block with dropout (0.5)."""
    code: str = ""
    """Checkpointing the model's own forward does: ``torch_reentrant`` / ``torch_non_reentrant``
    (``torch.utils.checkpoint`` around ``second``), ``smp`` (SMP's ``checkpoint`` around
    ``first`` and ``second``), ``smp_sequential:<strategy>`` (``checkpoint_sequential`` on
    ``seq``)."""
    microbatches: int = 2
    split: tuple[str, ...] = SPLIT
    """The modules on partition 1."""
    delayed: bool = False
    """Made inside ``smp.delay_param_initialization`` (each rank makes its share)."""


class _Net(nn.Module):
    def __init__(self, setup: Setup) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.code = setup.code
        self.inp = nn.Linear(4, DIM)
        self.first = _Block(0.5 if setup.dropout_in == "first" else 0.0)
        self.seq = nn.Sequential(*(_Block(0.0) for _ in range(4)))
        self.second = _Block(0.5 if setup.dropout_in == "second" else 0.0)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = checkpoint(self.first, h) if self.code == "smp" else self.first(h)
        if self.code.startswith("smp_sequential:"):
            h = checkpoint_sequential(self.seq, h, strategy=self.code.partition(":")[2])
        else:
            h = self.seq(h)
        if self.code.startswith("torch_"):
            reentrant = self.code == "torch_reentrant"
            h = torch.utils.checkpoint.checkpoint(self.second, h, use_reentrant=reentrant)
        elif self.code == "smp":
            h = checkpoint(self.second, h)
        else:
            h = self.second(h)
        return self.head(h)


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)


@dataclass
class Trained:
    losses: list[float]
    params: dict[str, Tensor]
    calls: dict[str, int] = field(default_factory=dict)
    """Forwards of each block on the rank that owns it."""


def reference(setup: Setup, device: str = "cpu") -> Trained:
    """One process, no checkpointing, same model and global batches."""
    model = _Net(Setup(dropout_in=setup.dropout_in)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in _batch(step))
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return Trained(losses, {k: v.detach().cpu() for k, v in model.state_dict().items()})


def _mark(module: nn.Module, setup: Setup) -> None:
    for name, kwargs in setup.marks:
        set_activation_checkpointing(module.get_submodule(name), **dict(kwargs))


def _train_steps(
    model: smp.DistributedModel, device: str, rows: slice = slice(None)
) -> list[float]:
    """``STEPS`` SGD steps of ``model`` on ``rows`` of the batches (each data-parallel rank
    its own), moved to ``device``; the losses of the whole batches."""
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: smp.DistributedModel, x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = (t[rows].to(device) for t in _batch(step))
        loss = train_step(model, x, y).reduce_mean().detach()
        optimizer.step()
        if smp.dp_size() > 1:
            dist.all_reduce(loss, group=smp.get_dp_process_group())
        losses.append(loss.item() / smp.dp_size())
    return losses


def _train_setups(setups: list[Setup]) -> list[Trained | None]:
    """On every rank of pp=2: train each setup in turn; pp rank 0 returns ``Trained``."""
    dist.init_process_group("gloo")
    results: list[Trained | None] = []
    for setup in setups:
        init_smp(2, "interleaved", setup.microbatches, auto=False)
        with smp.delay_param_initialization(enabled=setup.delayed):
            module = _Net(setup)
        for name in setup.split:
            smp.set_partition(module.get_submodule(name), 1)
        if not setup.marks_after_wrapping:
            _mark(module, setup)
        model = smp.DistributedModel(module)
        if setup.marks_after_wrapping:
            _mark(module, setup)
        losses = _train_steps(model, "cpu")
        params = model.state_dict()
        plan = model.partition_plan()
        owned = {
            name: module.get_submodule(name).calls
            for name in BLOCKS
            if plan.owner(name) == smp.pp_rank()
        }
        everywhere: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, owned)
        calls = {name: n for part in everywhere for name, n in part.items()}
        results.append(Trained(losses, params, calls) if smp.pp_rank() == 0 else None)
        smp.shutdown()
    dist.destroy_process_group()
    return results


def _marked(*names: str, **kwargs: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    return tuple((name, tuple(kwargs.items())) for name in names)


SETUPS: dict[str, tuple[Setup, tuple[str, ...]]] = {
    # name: (setup, the blocks whose forward is recomputed)
    "partition 0": (Setup(_marked("first")), ("first",)),
    "partition 1": (Setup(_marked("second"), marks_after_wrapping=True), ("second",)),
    "sequential each": (Setup(_marked("seq")), ("seq.0", "seq.1", "seq.2", "seq.3")),
    "delayed model": (Setup(_marked("first", "second"), delayed=True), ("first", "second")),
    "sequential contiguous": (
        Setup(_marked("seq", strategy="contiguous"), marks_after_wrapping=True),
        ("seq.0", "seq.1", "seq.2", "seq.3"),
    ),
    "sequential group_3": (
        Setup(_marked("seq", strategy="group_3", pack_args_as_tuple=True)),
        ("seq.0", "seq.1", "seq.2", "seq.3"),
    ),
    # Its argument must be a tensor on the caller (see the misuse below): ``seq`` stays local.
    "torch reentrant": (Setup(code="torch_reentrant", split=("second", "head")), ("second",)),
    "torch non-reentrant": (Setup(code="torch_non_reentrant"), ("second",)),
    "smp checkpoint": (Setup(code="smp"), ("first", "second")),
    "smp checkpoint_sequential group_2": (
        Setup(code="smp_sequential:group_2"),
        ("seq.0", "seq.1", "seq.2", "seq.3"),
    ),
    # The root runs on both partitions: each part of it is recomputed where it runs.
    "split module": (Setup(_marked("")), BLOCKS),
    "nothing": (Setup(), ()),
}


@pytest.fixture(scope="module")
def trained() -> dict[str, Trained]:
    setups = [setup for setup, _ in SETUPS.values()]
    rank0, _ = run_ranks(2, _train_setups, setups, timeout=240)
    return dict(zip(SETUPS, rank0, strict=True))


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_checkpointing_trains_like_one_process_and_recomputes_where_the_module_runs(
    trained: dict[str, Trained], name: str
) -> None:
    setup, recomputed = SETUPS[name]
    assert_equivalent(trained[name], reference(setup), name)
    forwards = STEPS * setup.microbatches
    # The reentrant checkpoint's forward calls ``second`` without grad, its backward again with.
    expected = {block: 2 * forwards if block in recomputed else forwards for block in BLOCKS}
    assert trained[name].calls == expected, name


DROPOUT = {
    # name: (setup, whether it must match one process)
    "partition 0": (Setup(_marked("first"), dropout_in="first", microbatches=1), True),
    "partition 1": (Setup(_marked("second"), dropout_in="second", microbatches=1), True),
    "rng state not preserved": (
        Setup(_marked("second", preserve_rng_state=False), dropout_in="second", microbatches=1),
        False,
    ),
}


@pytest.fixture(scope="module")
def trained_with_dropout() -> dict[str, Trained]:
    setups = [setup for setup, _ in DROPOUT.values()]
    rank0, _ = run_ranks(2, _train_setups, setups, timeout=240)
    return dict(zip(DROPOUT, rank0, strict=True))


@pytest.mark.parametrize("name", sorted(DROPOUT))
def test_dropout_inside_a_checkpointed_module_draws_the_same_mask_when_recomputed(
    trained_with_dropout: dict[str, Trained], name: str
) -> None:
    """With ``preserve_rng_state`` the recomputation draws the forward's dropout mask again, so
    training matches one process (every rank seeds alike and only the one block draws);
    without it the recomputed mask differs and so does training."""
    setup, matches = DROPOUT[name]
    expected = reference(setup)
    if matches:
        assert_equivalent(trained_with_dropout[name], expected, name)
    else:
        got = trained_with_dropout[name].params["second.fc1.weight"]
        assert not torch.allclose(got, expected.params["second.fc1.weight"], atol=1e-4)


# --- Hugging Face GPT-2 ------------------------------------------------------------------------


def test_gpt2_blocks_marked_on_two_partitions_train_like_one_process() -> None:
    pytest.importorskip("transformers")
    from tests.modelparallel.hf_cases import HF_ENV, Layout, reference, train_layouts

    layouts = [Layout("gpt2", "interleaved", 2, marked=True)]
    rank0, _ = run_ranks(2, train_layouts, layouts, STEPS, timeout=240, env=HF_ENV)
    assert_equivalent(rank0[0], reference("gpt2", STEPS), "gpt2 with marked blocks")
    assert rank0[0].extra["attention_calls"] == [2 * STEPS * 2] * 4, "recomputed once each"


# --- grouping and bad input ---------------------------------------------------------------------


def test_groups_follow_smps_example() -> None:
    """SMP's docs: [a, b, c, d, e], a and b on pp rank 0, c, d and e on 1, ``group_3``: a and
    b checkpointed together on rank 0, c, d and e together on rank 1. Here a Sequential run by
    rank 0 checkpoints c, d and e each on rank 1 (its calls keep their inputs there anyway)."""
    a, b, c, d, e = (nn.Linear(2, 2) for _ in range(5))
    partitions: list[object] = [0, 0, 1, 1, 1]
    assert group_runs([a, b, c, d, e], partitions, 0, 3) == [
        Group((a, b), True),
        Group((c, d, e), False),
    ]
    assert group_runs([a, b, c, d, e], partitions, 1, 3) == [
        Group((a, b), False),
        Group((c, d, e), True),
    ]
    assert group_runs([a, b, c, d, e], partitions, 1, 2) == [
        Group((a, b), False),
        Group((c, d), True),
        Group((e,), True),
    ]
    assert group_runs([a, b, c, d, e], partitions, 0, None) == [
        Group((a, b), True),
        Group((c, d, e), False),
    ]


def _owners(module: nn.Module, elsewhere: tuple[str, ...]) -> dict[str, int]:
    """Partition 1 for the modules named in ``elsewhere`` and below them, 0 for the rest."""
    return {
        name: int(any(name == e or name.startswith(f"{e}.") for e in elsewhere))
        for name, _ in module.named_modules()
    }


def test_a_checkpointed_module_cut_across_partitions_is_recomputed_in_parts() -> None:
    """Each largest subtree on one partition is checkpointed where it runs; a Sequential's
    child cut in two is checkpointed in parts, its whole children in groups as before."""
    module = _Net(Setup())
    set_activation_checkpointing(module)
    plan = activations.plan_checkpointing(module, _owners(module, SPLIT))
    assert set(plan.modules) == {"inp", "first", *(f"seq.{i}" for i in range(4)), "second", "head"}
    assert plan.sequentials == {}

    module = _Net(Setup())
    set_activation_checkpointing(module.seq, strategy="contiguous")
    plan = activations.plan_checkpointing(module, _owners(module, ("seq.1.fc2", "seq.3")))
    assert set(plan.modules) == {"seq.1.fc1", "seq.1.fc2", "seq.1.drop", "seq.3"}
    seq = module.seq
    assert plan.sequentials["seq"][1] == [
        Group((seq[0],), True),
        Group((seq[1],), False),
        Group((seq[2],), True),
        Group((seq[3],), False),
    ]


def test_the_partitions_that_recompute_are_those_running_a_marked_module() -> None:
    """Their backwards run whole, so a plan must not split them: a Sequential's children count
    on their own partitions, unmarked modules on partition 1 do not."""
    module = _Net(Setup())
    assert activations.checkpointing_partitions(module, _owners(module, ("seq.3",))) == set()
    set_activation_checkpointing(module.seq, strategy="each")
    assert activations.checkpointing_partitions(module, _owners(module, ("seq.3",))) == {0, 1}
    assert activations.checkpointing_partitions(module, _owners(module, ("head",))) == {0}


class _Pair(nn.Module):
    """Takes and returns a pair of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        left, right = pair
        return torch.tanh(self.fc(left) + right), left


@pytest.mark.parametrize("pack_args_as_tuple", [False, True])
def test_checkpoint_sequential_passes_tuples_through(pack_args_as_tuple: bool) -> None:
    """Torch's non-reentrant checkpointing hands a tuple input over as it is, so
    ``pack_args_as_tuple`` (SMP's fix for its reentrant function) changes nothing."""
    torch.manual_seed(0)
    seq = nn.Sequential(_Pair(), _Pair(), _Pair())
    left, right = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3)
    expected = seq((left, right))
    expected[0].sum().backward()
    grads = [p.grad.clone() for p in seq.parameters()]  # type: ignore[union-attr]
    seq.zero_grad()
    got = checkpoint_sequential(
        seq, (left, right), strategy="group_2", pack_args_as_tuple=pack_args_as_tuple
    )
    got[0].sum().backward()
    torch.testing.assert_close(got, expected)
    for param, grad in zip(seq.parameters(), grads, strict=True):
        torch.testing.assert_close(param.grad, grad)


@pytest.mark.parametrize(
    ("module", "kwargs", "match"),
    [
        (nn.Sequential(), {"strategy": "group_0"}, r"got 'group_0'; allowed: \"each\", "),
        (nn.Sequential(), {"strategy": "bogus"}, r"got 'bogus'; allowed: .*group_<n>"),
        (nn.Sequential(), {"strategy": "contigous"}, r"did you mean 'contiguous'"),
        (nn.Linear(2, 2), {"pack_args_as_tuple": True}, r"only for an nn\.Sequential, not Linear"),
        (nn.Linear(2, 2), {"strategy": "contiguous"}, r"got \"strategy='contiguous'\""),
        (nn.Linear(2, 2), {"preserve_rng_state": "yes"}, r"preserve_rng_state: got 'yes'"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(
    module: nn.Module, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        set_activation_checkpointing(module, **kwargs)


def test_a_module_list_marks_each_layer_as_it_never_runs_itself() -> None:
    """AWS's GPT-NeoX script marks HF's ``gpt_neox.layers`` (a ModuleList) with ``each``."""
    layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    set_activation_checkpointing(layers, preserve_rng_state=False, strategy="each")
    assert activations.kept_whole(layers) == {"0", "1"}  # the layers, not the list
    with pytest.raises(ModelParallelError, match=r"ModuleList has no forward .*got strategy='gr"):
        set_activation_checkpointing(layers, strategy="group_2")


def test_smp_checkpoint_takes_modules_only() -> None:
    with pytest.raises(TypeError, match=r"takes an nn\.Module .*got builtin_function"):
        checkpoint(torch.tanh, torch.ones(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Sequential, got Linear"):
        checkpoint_sequential(nn.Linear(2, 2), torch.ones(2))  # type: ignore[arg-type]


def _misuse(case: str) -> str:
    """What one misuse raises, on each rank of pp=2."""
    dist.init_process_group("gloo")
    init_smp(2, "interleaved", 2, auto=False)
    module = _Net(Setup(code="torch_reentrant" if case == "reentrant, deferred input" else ""))
    for name in SPLIT:
        smp.set_partition(module.get_submodule(name), 1)
    stranger = nn.Linear(2, 2)
    if case == "stranger before":
        set_activation_checkpointing(stranger)
    model = smp.DistributedModel(module)
    step = _sum_step()
    try:
        if case == "stranger after":
            set_activation_checkpointing(stranger)
        if case == "after the first step":
            step(model, torch.ones(4, 4))
            set_activation_checkpointing(module.first)
        for _ in range(2):  # the second step defers every call the first one made
            step(model, torch.ones(4, 4))
    except ModelParallelError as exc:
        return str(exc)
    finally:
        smp.shutdown()
        dist.destroy_process_group()
    return "nothing raised"


def _sum_step() -> Any:
    @smp.step
    def train(model: smp.DistributedModel, x: Tensor) -> Tensor:
        loss = model(x).sum()
        model.backward(loss)
        return loss

    return train


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("stranger before", "Linear that is not part of the model given to smp.DistributedModel"),
        ("stranger after", "Linear passed is not part of the model given to smp.Distributed"),
        ("after the first step", "called after the model's first step"),
        (
            "reentrant, deferred input",
            r"module 'second' \(partition 1\) is called inside reentrant torch.utils.checkpoint "
            r"with an argument that module 'seq.3' computed on partition 1 and nobody fetched",
        ),
    ],
)
def test_marks_that_cannot_be_honoured_fail_before_training(case: str, match: str) -> None:
    for message in run_ranks(2, _misuse, case, timeout=120):
        assert re.search(match, message), message


# --- offloading (GPUs only) -------------------------------------------------------------------


def test_offloading_leaves_what_is_not_on_a_gpu_where_it_is() -> None:
    """On the CPU there is nothing to offload: what the checkpoint saves stays as it is."""
    x = torch.randn(2, DIM, requires_grad=True)
    assert activations._to_host(x) is x and activations._to_device(x) is x


@pytest.mark.gpu
def test_an_offloaded_region_recomputes_its_dropout_masks_and_keeps_gradients_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checkpoint is given the GPU inputs themselves: it restores their GPU's random state
    for the recomputation, so dropout draws the masks the forward drew and the gradients are
    those of the module run plainly; the input it saved waited in pinned host memory, and the
    input's gradient is made on the GPU."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.5), nn.Linear(DIM, DIM)).cuda()
    x = torch.randn(16, DIM, device="cuda")
    offloaded: list[Any] = []
    to_host = activations._to_host

    def recorded(tensor: Tensor) -> Any:
        offloaded.append(to_host(tensor))
        return offloaded[-1]

    monkeypatch.setattr(activations, "_to_host", recorded)

    def gradients(run: Any) -> list[Tensor]:
        block.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_()
        torch.cuda.manual_seed(1)
        run(inputs).square().sum().backward()
        assert inputs.grad is not None
        return [inputs.grad, *(p.grad for p in block.parameters() if p.grad is not None)]

    spec = activations.CheckpointSpec()
    got = gradients(lambda h: activations._offloaded_call(block, spec, (h,), {}))
    expected = gradients(block)
    host = [saved.host for saved in offloaded if isinstance(saved, activations._HostCopy)]
    assert [(t.device.type, t.is_pinned()) for t in host] == [("cpu", True)]
    assert got[0].device == x.device
    for mine, plain in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, plain, rtol=0, atol=0)


def _offloading(offload: bool) -> dict[str, Any]:
    """pp=2 on one GPU with every block checkpointed; how many inputs went to host memory."""
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "auto_partition": False,
            "default_partition": 0,
            "offload_activations": offload,
        }
    )
    offloaded = 0
    to_host = activations._to_host

    def counting(tensor: Tensor) -> Any:
        nonlocal offloaded
        saved = to_host(tensor)
        offloaded += isinstance(saved, activations._HostCopy)
        return saved

    activations._to_host = counting  # type: ignore[assignment]
    module = _Net(Setup())
    for name in SPLIT:
        smp.set_partition(module.get_submodule(name), 1)
    for name in ("first", "seq", "second"):
        set_activation_checkpointing(module.get_submodule(name))
    model = smp.DistributedModel(module)
    losses = _train_steps(model, "cuda")
    trained = Trained(losses, {k: v.cpu() for k, v in model.state_dict().items()})
    smp.shutdown()
    return {"trained": trained, "offloaded": offloaded}


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_offloading_trains_like_one_process_on_the_gpu(
    offload: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu())
    ranks = run_ranks(2, _offloading, offload, timeout=300)
    # first, seq.0, seq.1 on rank 0; seq.2, seq.3, second on rank 1: one input each per forward
    forwards = STEPS * 2
    assert [r["offloaded"] for r in ranks] == ([3 * forwards] * 2 if offload else [0, 0])
    got, expected = ranks[0]["trained"], reference(Setup(), "cuda")
    torch.testing.assert_close(got.losses, expected.losses, rtol=1e-4, atol=1e-6)
    for name, value in expected.params.items():
        torch.testing.assert_close(got.params[name], value, rtol=1e-4, atol=1e-5, msg=name)


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(0.0) for _ in range(4))

    def forward(self, h: Tensor) -> Tensor:
        for block in self.blocks:
            h = block(h)
        return h


class _Wrapped(nn.Module):
    """``body``, a plain module of four blocks called once, is most of the model: free, the
    planner splits it between two partitions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, DIM)
        self.body = _Body()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(self.inp(x)))


def _owners_of_body(marked: bool) -> list[int]:
    dist.init_process_group("gloo")
    init_smp(2, "interleaved", 2, auto=True)
    module = _Wrapped()
    if marked:
        set_activation_checkpointing(module.body)
    model = smp.DistributedModel(module)

    @smp.step
    def train_step(model: smp.DistributedModel, x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    train_step(model, *_batch(0))
    plan = model.partition_plan()
    smp.shutdown()
    dist.destroy_process_group()
    return [plan.owner(f"body.blocks.{i}") for i in range(4)]


def test_the_planner_keeps_a_marked_module_on_one_partition() -> None:
    """Checkpointed as one region, ``body`` cannot span partitions: unmarked, the plan splits
    it; marked, it stays whole and the step runs."""
    assert len(set(run_ranks(2, _owners_of_body, False, timeout=120)[0])) == 2
    assert len(set(run_ranks(2, _owners_of_body, True, timeout=120)[0])) == 1

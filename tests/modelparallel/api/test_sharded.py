"""Sharded data parallelism (``sharded_data_parallel_degree``, FSDP2) trains like one process.

SGD with momentum on the global batch of 8: one process against 4 ranks sharding over 4
(FSDP) and over 2 with 2 replicas (HSDP), on our LM and on Hugging Face GPT-2 (tiny configs,
random weights), gradient clipping at ``sdp_gradient_clipping`` active in every step (the
reference clips with ``torch.nn.utils.clip_grad_norm_``). Losses agree to a relative 1e-5 and
parameters to 1e-5. The layouts of a case run one after another in one world, a layout again
after ``smp.shutdown`` too (an equal mesh must not pick up the destroyed groups of the first
from torch's DTensor caches). Checkpoints resume exactly, in fp32 and in bf16 (whose training
against one process is tested in ``test_half_precision.py``), of our LM and, in fp32, of GPT-2
made ``smp.nn``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.config.modelparallel import validate_mp_parameters
from dtrain.errors import ConfigError
from dtrain.modelparallel.api.sharded import shard_units
from tests.modelparallel import equivalence, hf_cases
from tests.modelparallel.harness import run_ranks
from tests.modelparallel.test_equivalence import assert_equivalent

GLOBAL_BATCH = 8
LR = 0.1
MOMENTUM = 0.9
"""SGD with momentum: optimizer state to shard, and linear in the gradients, so rounding
differences stay rounding differences (Adam turns a gradient that is zero but for rounding,
as the key projection's bias gets, into a full step of either sign)."""
STEPS = 3
CLIP = 0.5
"""Below the gradients' global norm in every step of both cases (the tests check it)."""

Batch = dict[str, Tensor]


SWAPPED = "gpt2 in smp.tensor_parallelism"
"""Hugging Face GPT-2 created inside ``smp.tensor_parallelism()`` (in a model-parallel job):
``smp.nn.DistributedTransformerLMHead``, whose head is tied to the word embedding and whose
modules' ``state_dict()`` gathers a DTensor whole."""


def build(case: str) -> nn.Module:
    if case == "lm":
        return equivalence.CASES["lm"].build()
    if case == SWAPPED:
        with smp.tensor_parallelism():
            return hf_cases.build("gpt2")
    return hf_cases.build(case)


def batch(case: str, step: int) -> Batch:
    if case == "lm":
        ids, labels = equivalence.CASES["lm"].batch(step)
        return {"input_ids": ids, "labels": labels}
    return hf_cases.CASES["gpt2" if case == SWAPPED else case].batch(step)


@dataclass(frozen=True)
class Run:
    case: str
    degree: int
    microbatches: int = 1
    threshold: int = 1000
    """``sdp_param_persistence_threshold``: small, so that our LM has several units."""
    clip: float = CLIP
    delayed: bool = False
    """Created inside ``smp.delay_param_initialization()``: made unit by unit when sharded."""
    bf16: bool = False
    """SMP's ``bf16``: computing in bfloat16 from the fp32 shards."""


@dataclass
class Trained:
    losses: list[float]
    params: dict[str, Tensor]
    norms: list[float]
    optimizer_elements: int = 0
    """Elements of optimizer state this rank holds."""
    momentum: dict[str, Tensor] | None = None
    shapes: dict[str, tuple[int, ...]] | None = None
    """The shape of each parameter in ``optimizer.fp16_groups``, by name."""


def reference(case: str, steps: int, clip: float) -> Trained:
    """One process, SGD with momentum on the whole batch, the gradients clipped to ``clip``."""
    model = build(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for index in range(steps):
        optimizer.zero_grad()
        loss = model(**batch(case, index))["loss"]
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    momentum = {n: optimizer.state[p]["momentum_buffer"] for n, p in model.named_parameters()}
    return Trained(losses, params, norms, momentum=momentum)


def init(run: Run) -> None:
    smp.init(
        {
            "ddp": True,
            "microbatches": run.microbatches,
            "sharded_data_parallel_degree": run.degree,
            "sdp_param_persistence_threshold": run.threshold,
            "sdp_gradient_clipping": run.clip,
            "bf16": run.bf16,
        }
    )


class Trainer:
    """A ``DistributedModel`` of a case's module with SGD, trained on its replica's rows."""

    def __init__(self, case: str, module: nn.Module) -> None:
        self.case = case
        self.model = smp.DistributedModel(module)
        self.optimizer = smp.DistributedOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        )

        @smp.step
        def train_step(model: smp.DistributedModel, batch: Batch) -> Tensor:
            loss = model(**batch)["loss"]
            model.backward(loss)
            return loss

        @smp.step
        def evaluation_step(model: smp.DistributedModel, batch: Batch) -> Tensor:
            return model(**batch)["loss"]

        self.train_step = train_step
        self.evaluation_step = evaluation_step

    def step(self, index: int) -> float:
        """One step on this rank's rows; the loss of the global batch."""
        self.optimizer.zero_grad()
        output = self.train_step(self.model, self.rows(index))
        self.optimizer.step()
        return self.global_loss(output.reduce_mean())

    def evaluate(self, index: int) -> float:
        """The loss of the global batch, without gradients."""
        with torch.no_grad():
            return self.global_loss(
                self.evaluation_step(self.model, self.rows(index)).reduce_mean()
            )

    def rows(self, index: int) -> Batch:
        """This replica's rows of batch ``index``."""
        rows = GLOBAL_BATCH // smp.dp_size()
        mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
        return {k: v[mine] for k, v in batch(self.case, index).items()}

    @staticmethod
    def global_loss(loss: Tensor) -> float:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=smp.get_dp_process_group())
        return loss.item() / smp.dp_size()

    def optimizer_elements(self) -> int:
        states = self.optimizer.local_state_dict()["state"]  # type: ignore[attr-defined]
        return sum(
            v.numel() for values in states.values() for k, v in values.items() if k != "step"
        )


def train_runs(runs: list[Run], steps: int) -> list[Trained]:
    """On every rank: each run in turn; the global losses and full parameters."""
    dist.init_process_group("gloo")
    results = []
    for run in runs:
        init(run)
        if run.delayed:
            with smp.delay_param_initialization():
                module = build(run.case)
            assert all(p.is_meta for p in module.parameters())
        else:
            module = build(run.case)
        trainer = Trainer(run.case, module)
        losses, norms = [], []
        for index in range(steps):
            losses.append(trainer.step(index))
            norms.append(trainer.optimizer._global_grad_norm)  # type: ignore[attr-defined]
        params = trainer.model.state_dict()
        names = {id(p): n for n, p in trainer.model.module.named_parameters()}
        groups = trainer.optimizer.fp16_groups  # type: ignore[attr-defined]
        shapes = {names[id(p)]: tuple(p.shape) for group in groups for p in group}
        results.append(Trained(losses, params, norms, trainer.optimizer_elements(), None, shapes))
        smp.shutdown()
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize(
    ("case", "microbatches"), [("lm", 2), ("gpt2", 1)]
)  # GPT-2's padding gives every pair of rows the same count of tokens, not every row
def test_sharded_and_hybrid_train_like_one_process(case: str, microbatches: int) -> None:
    runs = [Run(case, 4, microbatches), Run(case, 2, microbatches), Run(case, 2, microbatches)]
    results = run_ranks(4, train_runs, runs, STEPS, timeout=300)
    expected = reference(case, STEPS, CLIP)
    assert min(expected.norms) > CLIP, f"clipping never acted ({expected.norms})"
    full = sum(p.numel() for p in build(case).parameters())  # one momentum each
    # AWS's scripts save these shapes (from optimizer.fp16_groups) to rebuild the whole model.
    shapes = {name: tuple(p.shape) for name, p in build(case).named_parameters()}
    for index, run in enumerate(runs):
        for rank, trained in enumerate(results):
            assert_equivalent(trained[index], expected, f"{run}, rank {rank}")
            assert trained[index].norms == pytest.approx(expected.norms, rel=1e-5), run
            assert trained[index].shapes == shapes, run
        # Each rank holds the momentum of its shard only: a quarter, or a half (2 replicas).
        held = [trained[index].optimizer_elements for trained in results]
        assert sum(held) == full * 4 // run.degree, (run, held, full)
        assert max(held) <= full / run.degree * 1.2, (run, held, full)


def test_delayed_models_are_made_unit_by_unit_and_train_like_one_process() -> None:
    runs = [Run("lm", 2, microbatches=2, delayed=True), Run("gpt2", 2, delayed=True)]
    results = run_ranks(2, train_runs, runs, STEPS, timeout=300)
    for index, run in enumerate(runs):
        expected = reference(run.case, STEPS, CLIP)
        for rank, trained in enumerate(results):
            assert_equivalent(trained[index], expected, f"{run}, rank {rank}")


def test_units_are_blocks_or_large_submodules_never_a_tied_embedding() -> None:
    gpt2 = build("gpt2")
    assert [type(u).__name__ for u in shard_units(gpt2, 10**9)] == ["GPT2Block"] * 4
    lm = build("lm")
    names = {id(m): n for n, m in lm.named_modules()}
    units = [names[id(u)] for u in shard_units(lm, 1000)]
    # Every linear layer of the blocks (1056 to 4224 parameters); not the blocks, whose norms
    # are left (256); not the tied embedding and head (2048), which stay in the root.
    linears = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    assert units == [f"blocks.{i}.{name}" for i in range(4) for name in linears]
    assert shard_units(lm, 10**9) == []


def test_sdp_gradient_clipping_zero_turns_clipping_off() -> None:
    run = Run("lm", 2, clip=0.0)
    got = run_ranks(2, train_runs, [run], 2, timeout=120)[0][0]
    expected = reference("lm", 2, float("inf"))
    assert_equivalent(got, expected, str(run))
    assert got.norms == pytest.approx(expected.norms, rel=1e-5)  # measured all the same


@dataclass
class Resumed:
    straight: list[float]
    """Losses of steps 3 and 4 trained straight on (step 3 also evaluated without gradients)."""
    resumed: list[float]
    """Losses of steps 3 and 4 after resuming from the checkpoint of step 2."""
    saved: dict[str, Tensor]
    """The full state at the checkpoint."""
    finals: tuple[dict[str, Tensor], dict[str, Tensor]]
    """The full state after step 4, trained straight on and resumed."""
    params: set[str]
    """The parameters' names, a tied one under each."""


def save_and_resume(folder: str, partial: bool, bf16: bool, cases: list[str]) -> list[Resumed]:
    """For each case in turn (in its own subfolder of ``folder``): train 4 steps, saving after
    2 (having evaluated before, which leaves the root unit gathered); then a new model resumes
    from the save and trains the last 2 again."""
    dist.init_process_group("gloo")
    results = []
    for case in cases:
        path = str(Path(folder, case))
        run = Run(case, 2, microbatches=2 if case == "lm" else 1, bf16=bf16)
        init(run)
        first = Trainer(run.case, build(run.case))
        hooked: list[smp.DistributedModel] = []
        first.model.register_post_partition_hook(hooked.append)
        for index in range(2):
            first.step(index)
        first.evaluate(1)
        model, optimizer = first.model, first.optimizer
        smp.save_checkpoint(path, "two", partial=partial, model=model, optimizer=optimizer)
        saved = model.state_dict()
        optimizer_file = Path(path, f"optimizer_{smp.rank()}.pt")
        torch.save(first.optimizer.state_dict(), optimizer_file)  # full: gathered on every rank
        straight = [first.evaluate(2), first.step(2), first.step(3)]
        assert hooked == [first.model], "the post-partition hook runs once, before the first step"
        params = {name for name, _ in model.module.named_parameters(remove_duplicate=False)}
        final = model.state_dict()
        smp.reset()
        second = Trainer(run.case, build(run.case))
        smp.resume_from_checkpoint(path, partial=partial)
        if not partial:  # a full checkpoint holds no optimizer state (as in SMP): load it apart
            second.optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))
        resumed = [second.step(index) for index in (2, 3)]
        results.append(
            Resumed(straight, resumed, saved, (final, second.model.state_dict()), params)
        )
        smp.shutdown()
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("partial", [True, False], ids=["partial", "full"])
def test_checkpoint_resumes_identically(tmp_path: Path, partial: bool, bf16: bool) -> None:
    """Our LM; in fp32 also GPT-2 made ``smp.nn`` (whose partial state once held whole tensors
    gathered by its modules' ``state_dict()`` hooks, and loaded nothing), in the same world."""
    cases = ["lm"] if bf16 else ["lm", SWAPPED]
    ranks = run_ranks(2, save_and_resume, str(tmp_path), partial, bf16, cases, timeout=120)
    for index, case in enumerate(cases):
        for rank in ranks:
            got = rank[index]
            assert got.straight[0] == pytest.approx(got.straight[1], rel=1e-6), case
            assert got.resumed == pytest.approx(got.straight[1:], rel=1e-6), case
            for name, value in got.finals[0].items():
                assert torch.equal(got.finals[1][name], value), (case, name)
        folder = tmp_path / case
        if partial:  # each shard of the group in its own file; in bf16 no fp16_states files
            files = sorted(p.name for p in (folder / "two_partial").iterdir())
            assert files == [
                "model_0_0_0.pt", "model_0_0_1.pt", "optimizer_0_0_0.pt", "optimizer_0_0_1.pt"
            ]  # fmt: skip
            # A parameter's shards, in the order of the files, make it whole (FSDP2's dim-0
            # split, as the docs say for rebuilding a model from a partial checkpoint by hand);
            # a buffer is whole in each file.
            parts = [
                torch.load(folder / "two_partial" / f"model_0_0_{i}.pt", weights_only=True)
                for i in range(2)
            ]
            saved = parts[0]
            for name, value in ranks[0][index].saved.items():
                params = ranks[0][index].params
                whole = torch.cat([p[name] for p in parts]) if name in params else parts[1][name]
                assert torch.equal(whole, value), (case, name)
        else:
            saved = torch.load(folder / "two", weights_only=True)
        # The parameters are saved as the fp32 values the optimizer steps (the masters).
        assert {v.dtype for v in saved.values() if isinstance(v, torch.Tensor)} == {torch.float32}


@pytest.mark.parametrize(
    ("params", "world", "message"),
    [
        (
            {"sharded_data_parallel_degree": 2, "partitions": 2},
            4,
            "only together with pipeline_parallel_degree=1",
        ),
        ({"sharded_data_parallel_degree": 3}, 4, r"a divisor of the data-parallel degree 4"),
        (
            {"sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
            4,
            "only together with shard_optimizer_state=false",
        ),
    ],
)
def test_combinations_smp_refuses(params: dict[str, Any], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=f"sharded_data_parallel_degree: .*{message}"):
        validate_mp_parameters({"ddp": True, **params}, world_size=world)


def test_fp16_and_bf16_are_accepted_with_sharding_but_not_together() -> None:
    for half in ("fp16", "bf16"):
        values = {"ddp": True, "sharded_data_parallel_degree": 2, half: True}
        assert validate_mp_parameters(values, world_size=2)[half] is True
    both = {"ddp": True, "sharded_data_parallel_degree": 2, "fp16": True, "bf16": True}
    with pytest.raises(ConfigError, match=r"bf16: got True; allowed: only together with fp16"):
        validate_mp_parameters(both, world_size=2)


def train_pipelines(shard_optimizer_state: bool, steps: int) -> Trained:
    """pp=2 x dp=2 with bf16 parameters (fp32 masters), ``shard_optimizer_state`` or not."""
    dist.init_process_group("gloo")
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "ddp": True,
            "bf16": True,
            "shard_optimizer_state": shard_optimizer_state,
            "auto_partition": False,
            "default_partition": 0,
        }
    )
    module = build("lm")
    for name, partition in equivalence.CASES["lm"].split.items():
        smp.set_partition(module.get_submodule(name), partition)
    trainer = Trainer("lm", module)
    losses = [trainer.step(index) for index in range(steps)]
    trained = Trained(losses, trainer.model.state_dict(), [], trainer.optimizer_elements())
    smp.shutdown()
    dist.destroy_process_group()
    return trained


def test_shard_optimizer_state_with_half_precision_steps_the_masters_alike() -> None:
    sharded = run_ranks(4, train_pipelines, True, STEPS, timeout=300)
    whole = run_ranks(4, train_pipelines, False, STEPS, timeout=300)
    for rank, (got, expected) in enumerate(zip(sharded, whole, strict=True)):
        assert_equivalent(got, expected, f"rank {rank}")
        assert got.optimizer_elements < expected.optimizer_elements, rank


def train_zero(folder: str, steps: int) -> tuple[Trained, list[float]]:
    """pp=2 x dp=2 with ``shard_optimizer_state``: ``steps`` steps, a partial checkpoint
    before the last; then a new model resumes from it and takes the last step again. The
    trained result (with the gathered momentum) and the last loss after resuming."""
    dist.init_process_group("gloo")
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "ddp": True,
            "shard_optimizer_state": True,
            "auto_partition": False,
            "default_partition": 0,
        }
    )

    def pipelined() -> nn.Module:
        module = build("lm")
        for name, partition in equivalence.CASES["lm"].split.items():
            smp.set_partition(module.get_submodule(name), partition)
        return module

    first = Trainer("lm", pipelined())
    losses = [first.step(index) for index in range(steps - 1)]
    smp.save_checkpoint(folder, "zero", model=first.model, optimizer=first.optimizer)
    losses.append(first.step(steps - 1))
    full = first.optimizer.state_dict()  # gathered over the pipeline and the replicas
    momentum = {name: values["momentum_buffer"] for name, values in full["state"].items()}
    trained = Trained(losses, first.model.state_dict(), [], first.optimizer_elements(), momentum)
    smp.reset()
    second = Trainer("lm", pipelined())
    smp.resume_from_checkpoint(folder)
    resumed = [second.step(steps - 1)]
    smp.shutdown()
    dist.destroy_process_group()
    return trained, resumed


def test_shard_optimizer_state_with_pipelines_trains_like_one_process(tmp_path: Path) -> None:
    results = run_ranks(4, train_zero, str(tmp_path), STEPS, timeout=300)
    expected = reference("lm", STEPS, float("inf"))
    assert expected.momentum is not None
    for rank, (trained, resumed) in enumerate(results):
        assert_equivalent(trained, expected, f"rank {rank}")
        assert trained.momentum is not None and trained.momentum.keys() == expected.momentum.keys()
        for name, value in expected.momentum.items():
            assert (trained.momentum[name] - value).abs().max().item() <= 1e-5, name
        assert resumed == pytest.approx(trained.losses[-1:], rel=1e-6)
    # Every momentum element is held once in the world, and the two replicas of a stage hold
    # about half of the stage's each (ZeRO assigns whole parameters, balanced by size).
    total = sum(p.numel() for p in build("lm").parameters())
    assert sum(trained.optimizer_elements for trained, _ in results) == total
    for stage in (0, 1):  # cluster: pipelines [0, 1] and [2, 3]
        held = [results[rank][0].optimizer_elements for rank in (stage, stage + 2)]
        assert min(held) > 0 and max(held) <= 0.65 * sum(held), (stage, held)
    files = sorted(p.name for p in (tmp_path / "zero_partial").glob("optimizer_*"))
    assert files == [f"optimizer_{pp}_0_{dp}.pt" for pp in (0, 1) for dp in (0, 1)]

"""Training runs for the equivalence tests: the same model and data pipelined and in one process.

Each case names a reference model, how to split it by hand (so a skip, a module called twice and
a data-dependent branch all cross the partition boundary), its batches and its loss. The data of
:class:`~tests.modelparallel.models.BranchyNet` keeps the sign of every sample's sum equal
within a step (and alternating between steps), so each microbatch takes the branch the whole
batch takes and both branches train.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import dtrain.modelparallel as smp
from tests.modelparallel.models import BranchyNet, GroupedNet, ResidualTransformerLM

GLOBAL_BATCH = 8
LR = 0.1


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    split: dict[str, int]
    """Manual placement: module name → partition (the rest stays on partition 0)."""
    batch: Callable[[int], tuple[Tensor, Tensor]]
    loss: Callable[[nn.Module, Tensor, Tensor], Tensor]


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def _grouped_batch(step: int) -> tuple[Tensor, Tensor]:
    g = _generator(step)
    return torch.randn(GLOBAL_BATCH, 1, 12, 12, generator=g), torch.randint(
        0, 10, (8,), generator=g
    )


def _lm_batch(step: int) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, 64, (GLOBAL_BATCH, 16), generator=_generator(step))
    return ids, ids


def _branchy_batch(step: int) -> tuple[Tensor, Tensor]:
    g = _generator(step)
    sign = 1.0 if step % 2 == 0 else -1.0
    x = torch.rand(GLOBAL_BATCH, 8, generator=g).add(0.1) * sign
    return x, torch.randint(0, 2, (GLOBAL_BATCH,), generator=g)


def _branchy_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    out, aux = model(x)
    return F.cross_entropy(out, y) + 0.1 * aux.pow(2).mean()


CASES: dict[str, Case] = {
    "grouped": Case(
        lambda: GroupedNet(seed=0),
        {"group2": 1},
        _grouped_batch,
        lambda model, x, y: F.nll_loss(model(x), y),
    ),
    "lm": Case(
        lambda: ResidualTransformerLM(seed=0),
        {"blocks.2": 1, "blocks.3": 1, "ln_f": 1},
        _lm_batch,
        lambda model, ids, labels: model(ids, labels=labels)["loss"],
    ),
    "branchy": Case(
        lambda: BranchyNet(seed=0),
        {"negative": 1, "shared": 1, "pair": 1},
        _branchy_batch,
        _branchy_loss,
    ),
}


ALL_CASES: dict[str, Case] = {
    **CASES,
    "lm3": Case(  # a chain of three partitions: activations relay through the leader
        lambda: ResidualTransformerLM(seed=0, tie_weights=False),
        {"blocks.1": 1, "blocks.2": 2, "blocks.3": 2, "ln_f": 2, "lm_head": 2},
        _lm_batch,
        lambda model, ids, labels: model(ids, labels=labels)["loss"],
    ),
    "lm3tied": Case(  # three partitions and a head tied to the embedding: back to 0
        lambda: ResidualTransformerLM(seed=0),
        {"blocks.1": 1, "blocks.2": 2, "blocks.3": 2, "ln_f": 2},
        _lm_batch,
        lambda model, ids, labels: model(ids, labels=labels)["loss"],
    ),
}
"""The cases above (split over two partitions) and those split over more."""


@dataclass(frozen=True)
class Layout:
    case: str
    pipeline: str = "interleaved"
    microbatches: int = 2
    auto: bool = False
    placement: str = "cluster"


@dataclass
class Trained:
    losses: list[float]
    params: dict[str, Tensor]
    partitions_used: int = 1
    """How many partitions own at least one parameter (the plan really split the model)."""


def reference(case_name: str, steps: int) -> Trained:
    """Single-process SGD on the whole global batch."""
    case = ALL_CASES[case_name]
    model = case.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for index in range(steps):
        x, y = case.batch(index)
        optimizer.zero_grad()
        loss = case.loss(model, x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return Trained(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


def init_smp(
    pipeline_degree: int, pipeline: str, microbatches: int, auto: bool, placement: str = "cluster"
) -> None:
    """``smp.init`` for a test layout: a manual one starts everything on partition 0 (the case
    moves its split to partition 1); more ranks than stages are data-parallel replicas."""
    config: dict[str, Any] = {
        "pipeline_parallel_degree": pipeline_degree,
        "microbatches": microbatches,
        "pipeline": pipeline,
        "auto_partition": auto,
        "placement_strategy": placement,
        "ddp": dist.get_world_size() > pipeline_degree,
    }
    if not auto:
        config["default_partition"] = 0
    smp.init(config)


def case_pipeline(
    case: Case, auto: bool, delayed: bool = False, **model_options: Any
) -> tuple[smp.DistributedModel, Callable[[Tensor, Tensor], float]]:
    """The case's model as a ``smp.DistributedModel`` (split by hand unless ``auto``; created
    without memory if ``delayed``), and one SGD training step on a batch, which returns the
    step's mean loss."""
    with smp.delay_param_initialization(enabled=delayed):
        module = case.build()
    if not auto:
        for name, partition in case.split.items():
            smp.set_partition(module.get_submodule(name), partition)
    model = smp.DistributedModel(module, **model_options)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: smp.DistributedModel, x: Tensor, y: Tensor) -> Tensor:
        loss = case.loss(model, x, y)
        model.backward(loss)
        return loss

    def step(x: Tensor, y: Tensor) -> float:
        optimizer.zero_grad()
        loss = float(train_step(model, x, y).reduce_mean())
        optimizer.step()
        return loss

    return model, step


def replica_rows(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """This data-parallel replica's share of a global batch."""
    shard = GLOBAL_BATCH // smp.dp_size()
    rows = slice(smp.dp_rank() * shard, (smp.dp_rank() + 1) * shard)
    return x[rows], y[rows]


def train_layouts(layouts: Sequence[Layout], steps: int, pipeline_degree: int = 2) -> list[Any]:
    """On every rank: train each layout in turn; rank 0 of each data-parallel replica returns
    ``Trained`` (losses of its shard, the gathered full parameters), other ranks None."""
    dist.init_process_group("gloo")
    results = []
    for layout in layouts:
        case = CASES[layout.case]
        init_smp(
            pipeline_degree, layout.pipeline, layout.microbatches, layout.auto, layout.placement
        )
        model, step = case_pipeline(case, layout.auto)
        losses = [step(*replica_rows(*case.batch(index))) for index in range(steps)]
        params = model.state_dict()
        plan = model.partition_plan()
        used = {plan.owner(name.rpartition(".")[0]) for name, _ in model.module.named_parameters()}
        results.append(Trained(losses, params, len(used)) if smp.pp_rank() == 0 else None)
        smp.shutdown()
    dist.destroy_process_group()
    return results

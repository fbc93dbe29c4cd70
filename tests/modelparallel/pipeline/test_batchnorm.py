"""BatchNorm in train mode across pipeline partitions: the same statistics and parameters as one
process that runs the microbatches one after another.

Each microbatch normalizes with its own batch statistics and updates the running statistics
once, so the reference forwards every microbatch separately and averages the gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import dtrain.modelparallel as smp
from tests.modelparallel.harness import run_ranks
from tests.modelparallel.models import seeded

STEPS = 3
MICROBATCHES = 2
GLOBAL_BATCH = 8
LR = 0.1


class Half(nn.Module):
    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Half(1, 4)
        self.second = Half(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.second(self.first(x))
        return F.log_softmax(self.head(x.mean(dim=(2, 3))), dim=1)


def _build() -> nn.Module:
    return seeded(0, BatchNormNet).train()


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(GLOBAL_BATCH, 1, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _reference() -> dict[str, Tensor]:
    model = _build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    size = GLOBAL_BATCH // MICROBATCHES
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        for part in range(MICROBATCHES):
            rows = slice(part * size, (part + 1) * size)
            (F.nll_loss(model(x[rows]), y[rows]) / MICROBATCHES).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


LAYOUTS = [("simple", False), ("interleaved", False), ("interleaved", True)]
"""(pipeline, auto_partition): by hand, ``second`` and ``head`` go to partition 1."""


def _pipelined(layouts: list[tuple[str, bool]]) -> list[tuple[dict[str, Tensor], set[int]] | None]:
    """Per layout, on pp rank 0: the final state and the partitions owning a BatchNorm."""
    dist.init_process_group("gloo")
    results: list[tuple[dict[str, Tensor], set[int]] | None] = []
    for pipeline, auto in layouts:
        config: dict[str, Any] = {
            "pipeline_parallel_degree": 2,
            "microbatches": MICROBATCHES,
            "pipeline": pipeline,
            "auto_partition": auto,
        }
        if not auto:
            config["default_partition"] = 0
        smp.init(config)
        module = _build()
        if not auto:
            smp.set_partition(module.second, 1)
            smp.set_partition(module.head, 1)
        model = smp.DistributedModel(module)
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

        @smp.step
        def train_step(model: Any, x: Tensor, y: Tensor) -> Tensor:
            loss = F.nll_loss(model(x), y)
            model.backward(loss)
            return loss

        for step in range(STEPS):
            x, y = _batch(step)
            optimizer.zero_grad()
            train_step(model, x, y)
            optimizer.step()
        state = model.state_dict()  # collective: every rank gathers
        plan = model.partition_plan()
        owners = {plan.owner(name) for name in ("first.bn", "second.bn")}
        results.append((state, owners) if smp.pp_rank() == 0 else None)
        smp.shutdown()
    dist.destroy_process_group()
    return results


def test_batchnorm_statistics_and_parameters_match_microbatched_training() -> None:
    rank0, _ = run_ranks(2, _pipelined, LAYOUTS, timeout=90)
    expected = _reference()
    for layout, result in zip(LAYOUTS, rank0, strict=True):
        assert result is not None
        got, owners = result
        assert owners == {0, 1}, f"{layout}: both BatchNorms on partition {owners}"
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            if name.endswith("num_batches_tracked"):
                count, want = int(got[name]), int(value)
                assert count == want, f"{layout}: {name} {count} vs {want}"
                continue
            diff = (got[name] - value).abs().max().item()
            assert diff <= 1e-5, f"{layout}: {name} differs by {diff:.3g}"

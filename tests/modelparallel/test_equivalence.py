"""Pipelined (and hybrid) training equals single-process training on the same global batch.

10 SGD steps; losses agree to a relative 1e-5 and every final parameter to 1e-5 (absolute, on
values of order 1). Several layouts run one after another in one world to keep the suite fast.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.modelparallel.equivalence import CASES, Layout, Trained, reference, train_layouts
from tests.modelparallel.harness import run_ranks

STEPS = 10


def assert_equivalent(got: Trained, expected: Trained, what: str) -> None:
    losses, reference_losses = torch.tensor(got.losses), torch.tensor(expected.losses)
    relative = ((losses - reference_losses).abs() / reference_losses.abs()).max().item()
    assert relative <= 1e-5, f"{what}: losses {got.losses} vs {expected.losses}"
    assert got.params.keys() == expected.params.keys(), what
    for name, value in expected.params.items():
        diff = (got.params[name] - value).abs().max().item()
        assert diff <= 1e-5, f"{what}: parameter {name} differs by {diff:.3g}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_partitions_every_schedule_and_microbatch_count(case: str) -> None:
    layouts = [
        Layout(case, pipeline, microbatches)
        for pipeline, microbatches in itertools.product(("simple", "interleaved"), (1, 2, 4))
    ]
    rank0, _ = run_ranks(2, train_layouts, layouts, STEPS, timeout=240)
    expected = reference(case, STEPS)
    for layout, got in zip(layouts, rank0, strict=True):
        assert_equivalent(got, expected, str(layout))


def test_auto_partition_trains_like_one_process() -> None:
    layouts = [Layout(case, "interleaved", 4, auto=True) for case in sorted(CASES)]
    rank0, _ = run_ranks(2, train_layouts, layouts, STEPS, timeout=240)
    for layout, got in zip(layouts, rank0, strict=True):
        assert got.partitions_used == 2, f"{layout}: the automatic plan did not split the model"
        assert_equivalent(got, reference(layout.case, STEPS), str(layout))


def test_two_partitions_times_two_replicas() -> None:
    layouts = [Layout(case, "interleaved", 2) for case in sorted(CASES)]
    layouts.append(Layout("lm", "simple", 2, placement="spread"))
    results = run_ranks(4, train_layouts, layouts, STEPS, timeout=300)
    for index, layout in enumerate(layouts):
        leaders = [r[index] for r in results if r[index] is not None]
        assert len(leaders) == 2, "one pipeline leader per data-parallel replica"
        # Each replica saw half the batch: the global loss is the mean of the two.
        losses = [sum(pair) / 2 for pair in zip(*(t.losses for t in leaders), strict=True)]
        expected = reference(layout.case, STEPS)
        for trained in leaders:
            assert_equivalent(Trained(losses, trained.params), expected, str(layout))

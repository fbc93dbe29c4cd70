"""The order a reducer issues its stages' collectives in, with no processes: in order (NCCL), every
rank issues the same sequence whatever completes when; as ready (gloo), each stage keeps chunk
order and follows its previous stage."""

from __future__ import annotations

import random

import pytest

from dtrain.dataparallel.issue_order import IssueOrder

CHUNKS, STAGES = 5, 3


def issue_sequence(in_order: bool, seed: int) -> list[tuple[int, int]]:
    """One rank's backward: chunks' gradients arrive in order; collectives finish at random."""
    rng = random.Random(seed)
    order = IssueOrder(CHUNKS, STAGES, in_order)
    ready_upto, done, sequence = 0, set(), []
    while len(sequence) < CHUNKS * STAGES:
        ready_upto = min(CHUNKS, ready_upto + rng.randint(0, 1))
        for issued in sequence:
            if rng.random() < 0.3:
                done.add(issued)
        arrived = ready_upto
        step = order.next(
            lambda c, arrived=arrived: c < arrived,
            lambda c: (c, max(s for cc, s in sequence if cc == c)) in done,
        )
        if step is None:
            if ready_upto == CHUNKS and not in_order:
                done.update(sequence)  # the end of backward: waiting completes everything
            continue
        order.mark(*step)
        sequence.append(step)
    return sequence


def test_in_order_every_rank_issues_the_same_sequence() -> None:
    sequences = {tuple(issue_sequence(True, seed)) for seed in range(50)}
    assert sequences == {tuple((c, s) for c in range(CHUNKS) for s in range(STAGES))}


def test_as_ready_ranks_may_differ_but_each_stage_keeps_chunk_order() -> None:
    sequences = [issue_sequence(False, seed) for seed in range(50)]
    assert len({tuple(sequence) for sequence in sequences}) > 1  # timing decides: gloo only
    for sequence in sequences:
        for stage in range(STAGES):
            assert [c for c, s in sequence if s == stage] == list(range(CHUNKS))
        for c, stage in sequence:
            if stage:
                assert sequence.index((c, stage - 1)) < sequence.index((c, stage))


@pytest.mark.parametrize("in_order", [True, False])
def test_nothing_goes_before_its_gradients(in_order: bool) -> None:
    order = IssueOrder(2, STAGES, in_order)
    assert order.next(lambda c: False, lambda c: True) is None
    assert order.next(lambda c: c == 0, lambda c: True) == (0, 0)

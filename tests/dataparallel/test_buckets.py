"""The bucket plan is data: parameter sizes, ready order and cap in, balanced buckets out."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from dtrain.dataparallel.buckets import (
    balanced_cuts,
    bucket_count,
    greedy_count,
    plan_buckets,
    smallest_largest,
)


def greedy_sizes(sizes: list[int], cap: int) -> list[int]:
    """What a greedy fill (new bucket when the next item would overflow) makes."""
    buckets: list[int] = []
    for size in sizes:
        if not buckets or buckets[-1] + size > cap:
            buckets.append(0)
        buckets[-1] += size
    return buckets


def test_buckets_follow_ready_order_and_cover_every_parameter() -> None:
    sizes = [40, 8, 40, 8, 40, 8]
    order = [5, 4, 3, 2, 1, 0]
    plan = plan_buckets(sizes, order, cap_bytes=50)
    assert plan.order == order
    assert sum(plan.sizes) == sum(sizes)
    assert [b.nbytes for b in plan.buckets] == [
        sum(sizes[i] for i in b.params) for b in plan.buckets
    ]


def test_equal_items_split_evenly_where_greedy_leaves_a_sliver() -> None:
    sizes = [1] * 10
    assert greedy_sizes(sizes, 4) == [4, 4, 2]
    plan = plan_buckets(sizes, list(range(10)), cap_bytes=4)
    assert sorted(plan.sizes) == [3, 3, 4]


def test_count_is_a_perfect_packing_but_never_more_than_greedy() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 60))]
        cap = rng.randint(50, 1000)
        plan = plan_buckets(sizes, list(range(len(sizes))), cap)
        count = min(len(greedy_sizes(sizes, cap)), math.ceil(sum(sizes) / cap))
        assert len(plan.buckets) == count == bucket_count(sizes, cap)
        assert max(plan.sizes) < cap + max(sizes), "soft cap: less than one parameter over"


def test_largest_bucket_is_as_small_as_any_split_allows() -> None:
    rng = random.Random(1)
    for _ in range(100):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(2, 8))]
        cap = rng.randint(20, 120)
        plan = plan_buckets(sizes, list(range(len(sizes))), cap)
        k = len(plan.buckets)
        best = min(
            max(sum(sizes[a:b]) for a, b in itertools.pairwise([0, *cuts, len(sizes)]))
            for cuts in itertools.combinations(range(1, len(sizes)), k - 1)
        )
        assert max(plan.sizes) == best == smallest_largest(sizes, k)


def test_balance_beats_greedy_on_a_transformer_like_model() -> None:
    # one block in reverse order: norms, 1024x1024 mlp weights and biases, attention
    block = [1024, 1024, 1024 * 1024, 4096, 1024 * 1024, 1024, 1024, 1024, 786432, 3072]
    sizes = [4 * s for s in block * 4]
    cap = 4 * 1024 * 1024  # the size of the largest parameters: greedy isolates them
    plan = plan_buckets(sizes, list(range(len(sizes))), cap)
    greedy = greedy_sizes(sizes, cap)
    assert min(greedy) < 10_000, "greedy leaves slivers between the big parameters"
    assert len(plan.buckets) < len(greedy)
    assert max(plan.sizes) - min(plan.sizes) < (max(greedy) - min(greedy)) / 3
    assert max(plan.sizes) < cap + max(sizes)


def test_a_parameter_larger_than_the_cap_gets_its_own_bucket() -> None:
    plan = plan_buckets([100, 1, 1], [0, 1, 2], cap_bytes=10)
    assert [b.params for b in plan.buckets] == [(0,), (1, 2)]


def test_kinds_never_share_a_bucket_and_buckets_start_in_ready_order() -> None:
    sizes = [4, 4, 2, 2, 4]
    kinds = ["fp32", "fp32", "fp16", "fp16", "fp32"]
    plan = plan_buckets(sizes, [2, 0, 3, 1, 4], cap_bytes=100, kinds=kinds)
    assert [b.params for b in plan.buckets] == [(2, 3), (0, 1, 4)]


def test_cuts_are_increasing_and_leave_every_bucket_non_empty() -> None:
    sizes = [1, 1, 1, 1, 1000]
    cuts = balanced_cuts(sizes, cap=2)
    assert cuts == sorted(set(cuts)) and cuts[0] > 0 and cuts[-1] < 5
    assert len(cuts) + 1 == greedy_count(sizes, 2) == 3
    assert cuts[-1] == 4, "the big parameter alone: the smallest possible largest bucket"


def test_single_bucket_when_everything_fits() -> None:
    plan = plan_buckets([10, 20, 30], [2, 1, 0], cap_bytes=1000)
    assert [b.params for b in plan.buckets] == [(2, 1, 0)]
    assert math.isclose(plan.sizes[0], 60)


@pytest.mark.parametrize(("order", "cap"), [([0, 1], 10), ([0, 0, 1], 10), ([0, 1, 2], 0)])
def test_invalid_inputs(order: list[int], cap: int) -> None:
    with pytest.raises(ValueError):
        plan_buckets([1, 2, 3], order, cap)

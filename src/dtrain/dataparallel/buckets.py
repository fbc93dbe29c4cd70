"""The bucket plan as plain data: which parameters share which flat buffer, and in what order.

Gradients are packed into buckets in the order they become ready during backward, so a bucket's
all-reduce can start as soon as its last gradient arrives and overlap the rest of backward.

Sizes are balanced rather than filled greedily. A greedy fill leaves a remainder bucket, often
a sliver, and when parameters are about the cap's size, slivers between them. Each collective
costs roughly ``latency + bytes / bandwidth``; a sliver pays the latency for almost nothing, and
the largest bucket is the one backward hides worst (the last one's all-reduce is fully exposed,
a big one in the middle holds up those behind it, as buckets go out in order). So we take
``k = ceil(total / cap)`` buckets (never more than greedy: the fewest whose average fits the cap),
make the largest of them as small as any contiguous split of the ready order into ``k`` allows,
and within that place the cuts nearest the equal shares ``j * total / k``. The first all-reduce
then starts after about ``total / k`` bytes of gradient, and in hierarchical reduction every
bucket's shards are about the same size (Herring's "balanced fusion buffer"). As with DDP's
buckets the cap is soft: a bucket can exceed it by less than one parameter.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    """Parameter indices fused into one flat buffer, in packing order, and their total bytes."""

    params: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    """Buckets in launch order; every rank must hold the same plan (collectives match by order)."""

    buckets: tuple[Bucket, ...]

    @property
    def order(self) -> list[int]:
        """Parameter indices in packing order across all buckets."""
        return [index for bucket in self.buckets for index in bucket.params]

    @property
    def sizes(self) -> list[int]:
        """Bytes per bucket, in launch order."""
        return [bucket.nbytes for bucket in self.buckets]


def plan_buckets(
    sizes: Sequence[int],
    order: Sequence[int],
    cap_bytes: int,
    kinds: Sequence[Hashable] | None = None,
) -> BucketPlan:
    """Split ``order`` (parameter indices, first ready first) into balanced buckets.

    ``sizes[i]`` is parameter i's gradient size in bytes. Parameters of different ``kinds``
    (dtype and device) never share a flat buffer: each kind is planned on its own and the buckets
    are then ordered by when their first parameter becomes ready.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    if sorted(order) != list(range(len(sizes))):
        raise ValueError("order must list every parameter index exactly once")
    kinds = kinds if kinds is not None else [None] * len(sizes)
    position = {index: pos for pos, index in enumerate(order)}
    by_kind: dict[Hashable, list[int]] = {}
    for index in order:
        by_kind.setdefault(kinds[index], []).append(index)
    buckets: list[Bucket] = []
    for indices in by_kind.values():
        kind_sizes = [sizes[i] for i in indices]
        bounds = [0, *balanced_cuts(kind_sizes, cap_bytes), len(indices)]
        for start, stop in itertools.pairwise(bounds):
            buckets.append(Bucket(tuple(indices[start:stop]), sum(kind_sizes[start:stop])))
    buckets.sort(key=lambda bucket: position[bucket.params[0]])
    return BucketPlan(tuple(buckets))


def greedy_count(sizes: Sequence[int], cap: int) -> int:
    """Buckets a greedy fill makes: a new one whenever the next item would overflow the cap."""
    count, filled = 0, 0
    for size in sizes:
        if count == 0 or filled + size > cap:
            count, filled = count + 1, 0
        filled += size
    return count


def bucket_count(sizes: Sequence[int], cap: int) -> int:
    """As many buckets as perfect packing needs, ``ceil(total / cap)``, but never more than greedy.

    The greedy bound matters when one parameter is larger than the cap: ``[100, 1, 1]`` under a
    cap of 10 needs 2 buckets, not 11.
    """
    if not sizes:
        return 0
    return min(greedy_count(sizes, cap), max(1, math.ceil(sum(sizes) / cap)))


def smallest_largest(sizes: Sequence[int], count: int) -> int:
    """The smallest possible largest bucket when ``sizes`` is cut into ``count`` contiguous runs."""
    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        if greedy_count(sizes, middle) <= count:
            high = middle
        else:
            low = middle + 1
    return low


def balanced_cuts(sizes: Sequence[int], cap: int) -> list[int]:
    """Cut positions (item i starts a bucket) giving ``bucket_count`` balanced buckets.

    The largest bucket is as small as ``count`` contiguous buckets allow (``smallest_largest``);
    within that limit each cut is the feasible item boundary nearest its equal share
    ``j * total / count``: the run it closes fits the limit, and the items after it still fit
    into the buckets that remain, at least one item each.
    """
    count = bucket_count(sizes, cap)
    if count <= 1:
        return []
    n, total = len(sizes), sum(sizes)
    limit = smallest_largest(sizes, count)
    before = list(itertools.accumulate(sizes, initial=0))  # before[c]: bytes ahead of cut c
    # needed[c]: fewest buckets within the limit for items c.. (greedy is optimal for this)
    needed = [0] * (n + 1)
    for c in range(n - 1, -1, -1):
        needed[c] = 1 + needed[bisect.bisect_right(before, before[c] + limit) - 1]
    cuts: list[int] = []
    previous = 0
    for j in range(1, count):
        left = count - j
        low = max(previous + 1, next(c for c in range(previous + 1, n + 1) if needed[c] <= left))
        high = min(n - left, bisect.bisect_right(before, before[previous] + limit) - 1)
        target = total * j / count
        previous = min(range(low, high + 1), key=lambda c: (abs(before[c] - target), c))
        cuts.append(previous)
    return cuts

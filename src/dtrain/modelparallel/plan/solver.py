"""The automatic planner (SMP's ``auto_partition``): every module placed from a profile so that
the costliest partition costs as little as possible (what a module and a call cost: :mod:`.costs`).

Timings are noisy (a busy machine makes one layer's time jump several fold), so a plan must not
follow them where they cannot tell two plans apart. Modules built and called alike (repeated
identical layers) get one compute time, the median of theirs; and plans whose largest cost is
within :data:`TIME_TOLERANCE` of the best are taken as equally fast, the most balanced in
operations, then in memory (exact counts, free of noise), among them winning.

It goes in three steps:

1. **Atoms.** Walk the module tree from the root. A module is split into its children when its
   subtree costs more than one partition's share (``1 / partitions``), when a module below it is
   fixed, when a module below it shares a parameter with a module outside it (so that the tie
   holds only the modules sharing the parameter, not their whole ancestry), or when it never ran
   itself (a container such as ``nn.ModuleList``); otherwise it and its subtree are one atom. A
   module called more than once (a layer applied repeatedly, as in ALBERT) is never split unless
   a module below it is fixed: its parts would exchange every call's tensors. A split module
   keeps its own code and parameters as an atom of its own (its *glue*), and modules that never
   ran stay in their parent's atom.
2. **Constraints.** The root's glue is pinned to partition 0 (the leader runs the step body and
   the root's forward); atoms holding ``fixed`` modules are pinned where they are fixed; atoms
   holding modules that share a parameter are merged into one (the runtime keeps a parameter
   with the module owning it), placed where the first of them runs (or where one of them is
   pinned).
3. **Segments.** The free atoms, in execution order, are cut into ``partitions`` contiguous
   segments, segment ``k`` on partition ``k``, by exact dynamic programs over (partition, end of
   its segment): the first finds the least largest partition cost ``C``; among the cuts whose
   every partition costs at most ``(1 + TIME_TOLERANCE) × C``, the next finds the least largest
   partition operation count (floating-point operations of the forward, counted by torch) and
   keeps those within ``TIE_TOLERANCE`` of it; among those, the least largest partition memory;
   among those, the cuts within ``TIE_TOLERANCE`` of their least largest cost are ties, and the
   one with the least largest traffic (bytes in and out), then cost, wins.
   The programs are exact because what a partition costs, holds and moves depends only on its
   own segment: the traffic it pays is that of calls with exactly one end on it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from dtrain.modelparallel.errors import PartitionError
from dtrain.modelparallel.plan.costs import DEFAULT_BANDWIDTH, CostModel, check_weights
from dtrain.modelparallel.plan.partition import PartitionPlan, check_placements, costed_plan
from dtrain.modelparallel.plan.profile import ModelProfile, within
from dtrain.modelparallel.plan.rows import CutStep

TIME_TOLERANCE = 0.3
"""Plans whose largest partition cost is within this fraction of the best one's are equally good.

A module's time on a busy machine is easily 30% off. At 0.15, a tiny 4-layer GPT-2 whose root
code weighs as much as a block still had its cut moved by ±30% noise on every module in one
profile of eight (none at 0.3). Within the band the exact operation counts decide, then memory:
where memory alone decided, a plan could be up to this much slower than the fastest (an LM
whose head costs 7 blocks was cut 5 | 3 + head, 29% slower by its own profile, instead of
7 | 1 + head, for even memory)."""

TIE_TOLERANCE = 0.03
"""Among the plans equal in memory, those whose largest partition cost is within this fraction
of the best one's are ties, the one moving fewer bytes between partitions winning: moving a small
module's code off the slowest partition changes its cost by less than the noise."""


def auto_plan(
    profile: ModelProfile,
    partitions: int,
    *,
    memory_weight: float,
    fixed: Mapping[str, int] | None = None,
    whole: Collection[str] = (),
    bandwidth: float = DEFAULT_BANDWIDTH,
) -> PartitionPlan:
    """Place every module so that the costliest partition costs as little as possible; the
    modules named in ``whole`` (checkpointed as one region) are never split unless a module
    below them is fixed."""
    fixed = dict(fixed or {})
    check_weights(memory_weight, bandwidth)
    check_placements(profile, partitions, fixed)
    if fixed.get("", 0) != 0:
        raise PartitionError(
            f"the root module is fixed to partition {fixed['']}, but automatic partitioning "
            "keeps it on partition 0, where the step runs"
        )
    model = CostModel(profile, memory_weight, bandwidth)
    atoms = _Atoms(profile, model, partitions, fixed, set(whole))
    free = sorted((u for u in atoms.units if u.pin is None), key=lambda u: u.position)
    owners = {name: u.pin for u in atoms.units if u.pin is not None for name in u.members}
    segments, possible, choice = _best_segments(free, atoms, model, partitions)
    for k, segment in enumerate(segments):
        for unit in segment:
            owners.update(dict.fromkeys(unit.members, k))
    empty = [k for k in range(partitions) if k not in owners.values()]
    warnings = (
        [
            f"{_ranges(empty)} empty: the model splits into only {len(free)} placeable parts "
            f"besides the root's own code, fewer than the {partitions} partitions"
        ]
        if empty
        else []
    )
    plan = costed_plan(
        profile,
        partitions,
        owners,
        memory_weight=memory_weight,
        bandwidth=bandwidth,
        placements=atoms.labels,
        warnings=warnings,
    )
    return dataclasses.replace(plan, placeable=len(free), possible_cuts=possible, cut_choice=choice)


def _ranges(numbers: list[int]) -> str:
    """``partition 3`` or ``partitions 2, 5-9``: sorted numbers, consecutive ones as a range."""
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"partition {text} is" if len(numbers) == 1 else f"partitions {text} are"


@dataclass
class _Unit:
    """Modules that go to one partition together; ``pin`` is their partition once known."""

    members: list[str]
    position: int
    pin: int | None
    time: float = 0.0
    memory: int = 0
    flops: int = 0


class _Atoms:
    """Steps 1 and 2 of :func:`auto_plan`: the units (atoms, tied ones merged), pinned or free,
    and how each module got its place."""

    def __init__(
        self,
        profile: ModelProfile,
        model: CostModel,
        partitions: int,
        fixed: dict[str, int],
        whole: set[str],
    ) -> None:
        self.profile = profile
        self.fixed = fixed
        self.whole = whole
        self.cost = {name: model.cost(model.time[name], model.memory[name]) for name in model.time}
        self.share = sum(self.cost.values()) / partitions
        self.units: list[_Unit] = []
        self.unit_of: dict[str, _Unit] = {}
        self.labels: dict[str, str] = {}
        self._subtree_cost: dict[str, float] = {}
        self._ran_below: dict[str, bool] = {}
        self._fixed_below: dict[str, bool] = {}
        self._tied_out = _tied_outwards(profile)
        self._summarise("")
        self._place("", None)
        self._tie()
        for unit in self.units:
            unit.time = sum(model.time[name] for name in unit.members)
            unit.memory = sum(model.memory[name] for name in unit.members)
            unit.flops = sum(profile.modules[name].flops for name in unit.members)

    def _summarise(self, name: str) -> None:
        """Subtree cost, and whether a module below ran or is fixed (children first)."""
        cost, ran, fixed = self.cost[name], False, False
        for child in self.profile.modules[name].children:
            self._summarise(child)
            cost += self._subtree_cost[child]
            ran = ran or self.profile.modules[child].calls > 0 or self._ran_below[child]
            fixed = fixed or child in self.fixed or self._fixed_below[child]
        self._subtree_cost[name] = cost
        self._ran_below[name] = ran
        self._fixed_below[name] = fixed

    def _place(self, name: str, glue: _Unit | None) -> None:
        stats = self.profile.modules[name]
        if glue is not None and stats.calls == 0 and name not in self.fixed:
            self._join(glue, name, "inherited")
            for child in stats.children:
                self._place(child, glue)
            return
        pin = 0 if glue is None else self.fixed.get(name)
        unit = _Unit([], position=-1 if stats.order is None else stats.order, pin=pin)
        self.units.append(unit)
        self._join(unit, name, "manual" if name in self.fixed else "auto")
        big = self._ran_below[name] and self._subtree_cost[name] > self.share
        split = (
            glue is None
            or stats.calls == 0
            or self._fixed_below[name]
            or (stats.calls == 1 and name not in self.whole and (big or name in self._tied_out))
        )
        for child in stats.children:
            if split:
                self._place(child, unit)
            else:
                self._join_subtree(unit, child)

    def _join(self, unit: _Unit, name: str, label: str) -> None:
        unit.members.append(name)
        self.unit_of[name] = unit
        self.labels[name] = label

    def _join_subtree(self, unit: _Unit, name: str) -> None:
        self._join(unit, name, "inherited")
        for child in self.profile.modules[name].children:
            self._join_subtree(unit, child)

    def _tie(self) -> None:
        """Merge the units of modules sharing a parameter into the pinned or the first one."""
        for group in self.profile.tied_groups:
            pins = [(self.unit_of[n].pin, n) for n in group if self.unit_of[n].pin is not None]
            for pin, name in pins[1:]:
                if pin != pins[0][0]:
                    raise PartitionError(
                        f"modules {pins[0][1]!r} (partition {pins[0][0]}) and {name!r} "
                        f"(partition {pin}) share a parameter, so they must be on one partition"
                    )
            units = list({id(self.unit_of[n]): self.unit_of[n] for n in group}.values())
            pinned = [unit for unit in units if unit.pin is not None]
            target = pinned[0] if pinned else min(units, key=lambda unit: unit.position)
            for unit in units:
                if unit is target:
                    continue
                if self.labels[unit.members[0]] == "auto":
                    self.labels[unit.members[0]] = "tied"
                for name in unit.members:
                    target.members.append(name)
                    self.unit_of[name] = target
                self.units.remove(unit)


def _tied_outwards(profile: ModelProfile) -> set[str]:
    """Modules with a module below them that shares a parameter with a module outside them."""
    found: set[str] = set()
    for group in profile.tied_groups:
        for member in group:
            ancestor = profile.modules[member].parent
            while ancestor is not None:
                if not all(within(other, ancestor) for other in group):
                    found.add(ancestor)
                ancestor = profile.modules[ancestor].parent
    return found


_CUT_CHOICE = (
    ("cost", TIME_TOLERANCE),
    ("flops", TIE_TOLERANCE),
    ("memory", 0.0),
    ("cost", TIE_TOLERANCE),
    ("traffic", 0.0),
    ("cost", 0.0),
)
"""How step 3 chooses a cut: each step finds the least largest partition value of its measure
among the cuts every earlier step allowed, and allows those within its tolerance of that.
Operation counts, memory and traffic are exact, so timing noise cannot move the choices they
make; operations come first, being what the time mostly follows (a model whose operations
torch does not count, all zero, is left to memory)."""


def _best_segments(
    free: list[_Unit], atoms: _Atoms, model: CostModel, partitions: int
) -> tuple[list[list[_Unit]], int, list[CutStep]]:
    """Step 3 of :func:`auto_plan`: contiguous segments of ``free``, segment ``k`` on partition
    ``k`` (pinned units count where they are pinned), chosen by the steps of ``_CUT_CHOICE``;
    with how many cuts there were and what each step left.

    Every segment is non-empty when there are at least as many free units as partitions.
    """
    stage = _StageCosts(free, atoms, model, partitions)
    measures = {
        "cost": stage.cost,
        "flops": stage.flops,
        "memory": stage.memory,
        "traffic": stage.traffic,
    }
    n = len(free)
    gap = 1 if n >= partitions else 0  # least units per segment
    limits: list[tuple[Callable[[int, int, int], float], float]] = []

    def allowed(k: int, left: int, right: int) -> bool:
        return all(measure(k, left, right) <= limit for measure, limit in limits)

    possible = _count_cuts(n, partitions, gap, allowed)
    bounds: list[int] = []
    steps: list[CutStep] = []
    for name, tolerance in _CUT_CHOICE:
        least, bounds = _min_max_cuts(n, partitions, gap, measures[name], allowed)
        limit = least * (1 + tolerance)
        limits.append((measures[name], limit))
        # One cut left stays the only one: each later step keeps the cut it finds.
        left = 1 if steps and steps[-1].cuts == 1 else _count_cuts(n, partitions, gap, allowed)
        steps.append(CutStep(name, tolerance, least, limit, left))
    return [free[left:right] for left, right in itertools.pairwise(bounds)], possible, steps


def _count_cuts(n: int, partitions: int, gap: int, allowed: Callable[[int, int, int], bool]) -> int:
    """How many cuts :func:`_min_max_cuts` chooses among: every segment ``allowed``."""
    ways = [[0] * (n + 1) for _ in range(partitions)]
    for right in range(gap, n + 1):
        ways[0][right] = int(allowed(0, 0, right))
    for k in range(1, partitions):
        for right in range(n + 1):
            ways[k][right] = sum(
                ways[k - 1][left]
                for left in range(right - gap + 1)
                if ways[k - 1][left] and allowed(k, left, right)
            )
    return ways[-1][n]


def _min_max_cuts(
    n: int,
    partitions: int,
    gap: int,
    value: Callable[[int, int, int], float],
    allowed: Callable[[int, int, int], bool],
) -> tuple[float, list[int]]:
    """The cut of ``0..n`` into ``partitions`` segments of at least ``gap`` units, every segment
    ``allowed``, with the least largest ``value(k, left, right)``: that value and the bounds.

    Exact by dynamic programming over (partition, end of its segment), since a segment's value
    depends on nothing else; of equal cuts, the one with the earliest last bounds wins.
    """
    best = [[math.inf] * (n + 1) for _ in range(partitions)]
    start = [[0] * (n + 1) for _ in range(partitions)]
    for right in range(gap, n + 1):
        if allowed(0, 0, right):
            best[0][right] = value(0, 0, right)
    for k in range(1, partitions):
        for right in range(n + 1):
            for left in range(right - gap + 1):
                if best[k - 1][left] == math.inf or not allowed(k, left, right):
                    continue
                candidate = max(best[k - 1][left], value(k, left, right))
                if candidate < best[k][right]:
                    best[k][right] = candidate
                    start[k][right] = left
    bounds = [n]
    for k in range(partitions - 1, 0, -1):
        bounds.append(start[k][bounds[-1]])
    bounds.append(0)
    return best[-1][n], bounds[::-1]


class _StageCosts:
    """Cost and memory of partition ``k`` holding ``free[left:right]`` with its pinned units, in
    constant time from prefix sums: what the partition pays for traffic depends only on which
    units it holds (calls with exactly one end on it)."""

    def __init__(self, free: list[_Unit], atoms: _Atoms, model: CostModel, partitions: int) -> None:
        self.model = model
        n = len(free)
        index = {id(unit): i for i, unit in enumerate(free)}
        self.pinned_time = [0.0] * partitions
        self.pinned_memory = [0] * partitions
        self.pinned_flops = [0] * partitions
        for unit in atoms.units:
            if unit.pin is not None:
                self.pinned_time[unit.pin] += unit.time
                self.pinned_memory[unit.pin] += unit.memory
                self.pinned_flops[unit.pin] += unit.flops
        # Bytes moved by calls between units: free-free, free-pinned and pinned-pinned.
        free_degree = [0] * n
        earlier: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        pinned_degree = [[0] * n for _ in range(partitions)]
        self.pinned_total = [0] * partitions
        self.pinned_pinned = [0] * partitions
        for caller, callee, sent, returned in model.calls:
            a, b = atoms.unit_of[caller], atoms.unit_of[callee]
            moved = sent + returned
            if a is b or not moved:
                continue
            if a.pin is None and b.pin is None:
                i, j = sorted((index[id(a)], index[id(b)]))
                free_degree[i] += moved
                free_degree[j] += moved
                earlier[j].append((i, moved))
            elif a.pin is not None and b.pin is not None:
                if a.pin != b.pin:
                    self.pinned_pinned[a.pin] += moved
                    self.pinned_pinned[b.pin] += moved
            else:
                unit, pin = (a, b.pin) if b.pin is not None else (b, a.pin)
                assert pin is not None
                pinned_degree[pin][index[id(unit)]] += moved
                self.pinned_total[pin] += moved
        self.time_sum = _prefix([unit.time for unit in free])
        self.memory_sum = _prefix([unit.memory for unit in free])
        self.flops_sum = _prefix([unit.flops for unit in free])
        self.free_sum = _prefix(free_degree)
        self.pinned_sum = [_prefix(row) for row in pinned_degree]
        self.all_pinned_sum = _prefix([sum(column) for column in zip(*pinned_degree, strict=True)])
        # internal[l][r]: bytes of calls with both ends in free[l:r].
        self.internal = [[0] * (n + 1) for _ in range(n + 1)]
        for left in range(n):
            inside = 0
            for right in range(left + 1, n + 1):
                inside += sum(moved for i, moved in earlier[right - 1] if i >= left)
                self.internal[left][right] = inside
        self._costs: dict[tuple[int, int, int], float] = {}

    def memory(self, k: int, left: int, right: int) -> int:
        return self.memory_sum[right] - self.memory_sum[left] + self.pinned_memory[k]

    def flops(self, k: int, left: int, right: int) -> int:
        return self.flops_sum[right] - self.flops_sum[left] + self.pinned_flops[k]

    def cost(self, k: int, left: int, right: int) -> float:
        key = (k, left, right)
        if key not in self._costs:
            self._costs[key] = self.model.cost(self._time(k, left, right), self.memory(*key))
        return self._costs[key]

    def traffic(self, k: int, left: int, right: int) -> int:
        """Bytes of the calls with exactly one end on the partition, both ways."""
        own = self.pinned_sum[k][right] - self.pinned_sum[k][left]
        return (
            self.free_sum[right]
            - self.free_sum[left]
            - 2 * self.internal[left][right]
            + self.all_pinned_sum[right]
            - self.all_pinned_sum[left]
            - 2 * own
            + self.pinned_total[k]
            + self.pinned_pinned[k]
        )

    def _time(self, k: int, left: int, right: int) -> float:
        compute = self.time_sum[right] - self.time_sum[left] + self.pinned_time[k]
        return compute + self.model.comm_time(self.traffic(k, left, right))


def _prefix(values: list[Any]) -> list[Any]:
    """``sums[i]`` is the sum of ``values[:i]``."""
    return list(itertools.accumulate(values, initial=0))

"""Partition plans: the dynamic program is exact, costs and constraints move the cuts as they
should, real models get valid plans, and manual placement follows SMP's rules."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator, Mapping, Sequence

import pytest

from dtrain.modelparallel.errors import PartitionError
from dtrain.modelparallel.plan.partition import PartitionPlan, costed_plan, manual_plan
from dtrain.modelparallel.plan.profile import (
    ModelProfile,
    ModuleStats,
    ProfiledCall,
    parent_name,
)
from dtrain.modelparallel.plan.solver import _CUT_CHOICE, auto_plan
from tests.modelparallel import profiles
from tests.modelparallel.models import GroupedNet, ResidualTransformerLM

MS = 1e-3


def hand_profile(
    modules: Mapping[str, tuple[float, int] | tuple[float, int, int]],
    calls: Sequence[tuple[str, int, int, int]],
    tied: Sequence[list[str]] = (),
) -> ModelProfile:
    """``modules``: name -> (seconds, parameter bytes[, operations]), parents first; ``calls``:
    (module, caller call index, input bytes, output bytes) in execution order, the root's call
    first."""
    stats: dict[str, ModuleStats] = {}
    for name, (seconds, param_bytes, *flops) in modules.items():
        parent = parent_name(name, set(modules))
        stats[name] = ModuleStats(
            name=name,
            type=f"T{name.rpartition('.')[2]}",
            parent=parent,
            forward_exclusive=seconds,
            param_bytes=param_bytes,
            param_count=param_bytes // 4,
            flops=flops[0] if flops else 0,
        )
        if parent is not None:
            stats[parent].children.append(name)
    records = []
    for index, (name, caller, sent, returned) in enumerate(calls):
        records.append(ProfiledCall(index, name, caller, sent, returned))
        stats[name].calls += 1
        if stats[name].order is None:
            stats[name].order = index
    for index, group in enumerate(tied):
        for name in group:
            stats[name].tied_group = index
    return ModelProfile(modules=stats, calls=records, tied_groups=list(tied), repeats=1)


def chain(
    times_ms: Sequence[float],
    param_bytes: Sequence[int] | None = None,
    moved: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
    tied: Sequence[list[str]] = (),
) -> ModelProfile:
    """A root calling ``m0, m1, ...`` in turn; call ``i`` sends and returns ``moved[i]`` bytes."""
    names = list(names or (f"m{i}" for i in range(len(times_ms))))
    param_bytes = param_bytes or [0] * len(names)
    moved = moved or [0] * len(names)
    modules = {"": (0.0, 0)} | {
        name: (t * MS, p) for name, t, p in zip(names, times_ms, param_bytes, strict=True)
    }
    calls = [("", -1, 0, 0)] + [(name, 0, b, b) for name, b in zip(names, moved, strict=True)]
    return hand_profile(modules, calls, tied)


def slowest(plan: PartitionPlan) -> float:
    return max(plan.stage_costs)


def measures(plan: PartitionPlan) -> dict[str, float]:
    """The largest partition cost, operation count, memory and traffic (bytes sent and
    received) of a plan."""
    sent = plan.traffic
    moved = [sum(sent[k]) + sum(row[k] for row in sent) for k in range(plan.partitions)]
    memory = max(stage.memory_bytes for stage in plan.stages)
    flops = max(stage.flops for stage in plan.stages)
    return {"cost": slowest(plan), "flops": flops, "memory": memory, "traffic": max(moved)}


def splits(items: list[str], parts: int, allow_empty: bool) -> Iterator[list[list[str]]]:
    """Every way to cut ``items`` into ``parts`` contiguous segments."""
    low = 0 if allow_empty else 1
    for cuts in itertools.combinations_with_replacement(range(len(items) + 1), parts - 1):
        bounds = [0, *cuts, len(items)]
        segments = [items[a:b] for a, b in itertools.pairwise(bounds)]
        if all(len(segment) >= low for segment in segments):
            yield segments


# --- the dynamic program is exact ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_dynamic_program_matches_brute_force(seed: int) -> None:
    """The cut the steps of the choice (cost within a tolerance, memory, ...) lead to, exactly."""
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    partitions = rng.randint(1, 4)
    names = [f"m{i}" for i in range(n)]
    sized = seed % 2 == 0  # else no parameters: memory ties and traffic decides
    counted = seed % 3 == 0  # else no operations counted: they tie and memory decides
    modules = {"": (rng.uniform(0, 2) * MS, rng.randrange(0, 4000) * sized)} | {
        name: (
            rng.uniform(0.1, 5) * MS,
            rng.randrange(0, 40_000) * sized,
            rng.randrange(0, 10**9) * counted,
        )
        for name in names
    }
    # Some modules are called from an earlier sibling's code rather than the root's.
    calls = [("", -1, 0, 0)]
    for i, name in enumerate(names):
        caller = rng.choice([0, *range(1, i + 1)])
        calls.append((name, caller, rng.randrange(0, 300_000), rng.randrange(0, 300_000)))
    profile = hand_profile(modules, calls)
    fixed = {name: rng.randrange(partitions) for name in names if rng.random() < 0.25}
    memory_weight = rng.choice([0.0, 0.3, 1.0])
    bandwidth = 1e8

    plan = auto_plan(
        profile, partitions, memory_weight=memory_weight, fixed=fixed, bandwidth=bandwidth
    )

    free = [name for name in names if name not in fixed]
    candidates: list[dict[str, float]] = []
    for segments in splits(free, partitions, allow_empty=len(free) < partitions):
        owners = {"": 0} | fixed
        for k, segment in enumerate(segments):
            owners.update(dict.fromkeys(segment, k))
        candidate = costed_plan(
            profile, partitions, owners, memory_weight=memory_weight, bandwidth=bandwidth
        )
        candidates.append(measures(candidate))
    for name, tolerance in _CUT_CHOICE:  # each step keeps the cuts near its least value
        least = min(candidate[name] for candidate in candidates)
        candidates = [c for c in candidates if c[name] <= least * (1 + tolerance) + 1e-12]
    got = measures(plan)
    assert got["flops"] == candidates[0]["flops"]
    assert got["memory"] == candidates[0]["memory"]
    assert got["traffic"] == candidates[0]["traffic"]
    assert got["cost"] == pytest.approx(candidates[0]["cost"], rel=1e-9, abs=1e-12)
    assert plan.owners[""] == 0
    assert all(plan.owners[name] == k for name, k in fixed.items())


# --- what moves the cuts ---------------------------------------------------------------------


def test_memory_weight_moves_the_cut() -> None:
    profile = chain([3, 1, 1, 1], param_bytes=[0, 100, 100, 200])
    by_time = auto_plan(profile, 2, memory_weight=0.0)
    by_memory = auto_plan(profile, 2, memory_weight=1.0)
    assert [by_time.owner(f"m{i}") for i in range(4)] == [0, 1, 1, 1]
    assert [by_memory.owner(f"m{i}") for i in range(4)] == [0, 0, 0, 1]
    assert by_time.stage_costs == pytest.approx([0.5, 0.5])
    assert by_memory.stage_costs == pytest.approx([0.5, 0.5])


def test_crossing_bytes_move_the_cut() -> None:
    quiet = chain([1, 1, 1, 1])
    assert [auto_plan(quiet, 2, memory_weight=0.0).owner(f"m{i}") for i in range(4)] == [
        0,
        0,
        1,
        1,
    ]
    # m2's arguments and outputs are large: sending them costs as much as half the compute.
    heavy = chain([1, 1, 1, 1], moved=[0, 0, 500_000, 1_000])
    plan = auto_plan(heavy, 2, memory_weight=0.0, bandwidth=1e9)
    assert [plan.owner(f"m{i}") for i in range(4)] == [0, 0, 0, 1]
    assert plan.traffic == [[0, 1_000], [1_000, 0]]
    assert plan.stages[1].comm_time == pytest.approx(2_000 / 1e9)


def test_tied_modules_share_the_first_ones_partition() -> None:
    names = ["wte", "b0", "b1", "b2", "b3", "head"]
    profile = chain([1, 2, 2, 2, 2, 1], names=names, tied=[["wte", "head"]])
    plan = auto_plan(profile, 2, memory_weight=0.0)
    assert plan.owner("head") == plan.owner("wte") == 0
    assert plan.modules["head"].placement == "tied"
    assert plan.modules["wte"].placement == "auto"
    assert plan.stages[0].compute_time == pytest.approx(
        sum(plan.modules[name].compute_time for name in names if plan.owner(name) == 0)
    )
    assert plan.owner("b3") == 1


def test_tied_module_follows_a_fixed_partner() -> None:
    names = ["wte", "b0", "b1", "head"]
    profile = chain([1, 2, 2, 1], names=names, tied=[["wte", "head"]])
    plan = auto_plan(profile, 2, memory_weight=0.0, fixed={"head": 1})
    assert plan.owner("wte") == plan.owner("head") == 1
    assert plan.modules["wte"].placement == "tied"
    assert plan.modules["head"].placement == "manual"
    with pytest.raises(PartitionError, match=r"'wte' \(partition 0\) and 'head' \(partition 1\)"):
        auto_plan(profile, 2, memory_weight=0.0, fixed={"wte": 0, "head": 1})


def test_fixed_placements_are_honoured_even_against_execution_order() -> None:
    profile = chain([1, 1, 1, 1, 1, 1])
    plan = auto_plan(profile, 3, memory_weight=0.0, fixed={"m5": 0, "m1": 2})
    assert plan.owner("m5") == 0 and plan.owner("m1") == 2
    assert plan.modules["m5"].placement == plan.modules["m1"].placement == "manual"
    free = [plan.owner(name) for name in ("m0", "m2", "m3", "m4")]
    assert free == sorted(free) and set(free) == {0, 1, 2}


@pytest.mark.parametrize(
    ("fixed", "message"),
    [
        ({"m1": 2}, "module 'm1' is placed on partition 2, but there are 2 partitions: "
                    "allowed 0..1"),
        ({"m1": -1}, "partition -1"),
        ({"m9": 0}, "there is no module 'm9'"),
        ({"": 1}, "the root module is fixed to partition 1"),
    ],
)  # fmt: skip
def test_invalid_fixed_placements(fixed: dict[str, int], message: str) -> None:
    with pytest.raises(PartitionError, match=re.escape(message)):
        auto_plan(chain([1, 1]), 2, memory_weight=0.0, fixed=fixed)


def test_misspelt_fixed_module_gets_a_suggestion() -> None:
    profile = chain([1, 1], names=["encoder", "decoder"])
    with pytest.raises(PartitionError, match="did you mean 'decoder'"):
        auto_plan(profile, 2, memory_weight=0.0, fixed={"decodr": 1})


@pytest.mark.parametrize(
    ("partitions", "memory_weight", "message"),
    [(0, 0.5, "partitions is 0"), (2, 1.5, "memory_weight is 1.5")],
)
def test_invalid_arguments(partitions: int, memory_weight: float, message: str) -> None:
    with pytest.raises(PartitionError, match=message):
        auto_plan(chain([1]), partitions, memory_weight=memory_weight)


def test_fewer_atoms_than_partitions_leaves_partitions_empty() -> None:
    plan = auto_plan(chain([1, 1]), 4, memory_weight=0.5)
    used = set(plan.owners.values())
    assert used <= {0, 1, 2, 3} and len(used) <= 3
    empty = [k for k in range(4) if k not in used]
    assert len(empty) >= 1 and len(plan.warnings) == 1  # one warning names them all
    assert "fewer than the 4 partitions" in plan.warnings[0]
    assert all(str(k) in plan.warnings[0] for k in empty)
    assert "warning: partition" in plan.table()


@pytest.mark.parametrize(
    ("numbers", "text"),
    [([3], "partition 3 is"), ([2, 5, 6, 7, 9], "partitions 2, 5-7, 9 are")],
)
def test_empty_partitions_are_named_as_ranges(numbers: list[int], text: str) -> None:
    from dtrain.modelparallel.plan.solver import _ranges

    assert _ranges(numbers) == text


def test_auto_beats_an_equal_layer_split_of_an_unbalanced_model() -> None:
    names = ["embed", *(f"b{i}" for i in range(8)), "head"]
    big = 400_000
    profile = chain(
        [6, *[1] * 8, 6], param_bytes=[big, *[20_000] * 8, big], names=names
    )  # fmt: skip
    equal_layers = {"": 0, "embed": 0, "head": 3} | {f"b{i}": i // 2 for i in range(8)}
    for weight in (0.0, 0.5, 1.0):
        auto = auto_plan(profile, 4, memory_weight=weight)
        equal = costed_plan(profile, 4, equal_layers, memory_weight=weight)
        # The optimum: no partition costs more than the heaviest module alone.
        assert slowest(auto) == pytest.approx(auto.modules["embed"].cost)
        assert slowest(auto) < slowest(equal)
        assert auto.owner("embed") == 0 and auto.owner("head") == 3


def test_within_the_noise_band_operations_decide_before_memory() -> None:
    """The benchmark's unbalanced LM: 8 blocks and a head with a large vocabulary (6 blocks'
    time and operations, most of the memory). Cut 5 | 3 + head is the most even in memory and
    within 30% of the fastest, but 7 | 1 + head is even in operations, which time follows."""
    names = ["embed", *(f"b{i}" for i in range(8)), "head"]
    modules = {"": (0.0, 0, 0)} | {
        name: (
            (6.0 if name == "head" else 1.0 if name.startswith("b") else 0.1) * MS,
            {"embed": 16_000_000, "head": 16_000_000}.get(name, 800_000),
            {"head": 6_000_000, "embed": 0}.get(name, 1_000_000),
        )
        for name in names
    }
    calls = [("", -1, 0, 0)] + [(name, 0, 1000, 1000) for name in names]
    plan = auto_plan(hand_profile(modules, calls), 2, memory_weight=0.2)
    assert [plan.owner(f"b{i}") for i in range(8)] == [0] * 7 + [1]
    assert [stage.flops for stage in plan.stages] == [7_000_000, 7_000_000]
    without_counts = hand_profile({name: module[:2] for name, module in modules.items()}, calls)
    memory_even = auto_plan(without_counts, 2, memory_weight=0.2)  # nothing counted: memory
    assert sum(memory_even.owner(f"b{i}") == 0 for i in range(8)) < 7
    largest = [max(s.memory_bytes for s in p.stages) for p in (memory_even, plan)]
    assert largest[0] < largest[1]


# --- atoms -----------------------------------------------------------------------------------


def nested_profile() -> ModelProfile:
    """root -> enc (big: split) -> enc.a, enc.b; blocks (never runs) -> blocks.0, blocks.1;
    small (cheap: one atom) -> small.x; unused (never runs, has parameters)."""
    modules = {
        "": (0.0, 0),
        "enc": (1 * MS, 0),
        "enc.a": (4 * MS, 0),
        "enc.b": (4 * MS, 0),
        "blocks": (0.0, 0),
        "blocks.0": (4 * MS, 0),
        "blocks.1": (4 * MS, 0),
        "small": (1 * MS, 0),
        "small.x": (1 * MS, 0),
        "unused": (0.0, 4000),
    }
    calls = [
        ("", -1, 0, 0),
        ("enc", 0, 10, 10),
        ("enc.a", 1, 10, 10),
        ("enc.b", 1, 10, 10),
        ("blocks.0", 0, 10, 10),
        ("blocks.1", 0, 10, 10),
        ("small", 0, 10, 10),
        ("small.x", 6, 10, 10),
    ]
    return hand_profile(modules, calls)


def test_big_modules_split_small_ones_stay_whole_idle_ones_inherit() -> None:
    plan = auto_plan(nested_profile(), 3, memory_weight=0.0)
    placements = {name: entry.placement for name, entry in plan.modules.items()}
    assert placements == {
        "": "auto",
        "enc": "auto",
        "enc.a": "auto",
        "enc.b": "auto",
        "blocks": "inherited",
        "blocks.0": "auto",
        "blocks.1": "auto",
        "small": "auto",
        "small.x": "inherited",
        "unused": "inherited",
    }
    assert plan.owner("small.x") == plan.owner("small")
    assert plan.owner("blocks") == plan.owner("unused") == plan.owner("") == 0
    assert plan.owner("enc.a") != plan.owner("enc.b")  # only possible because enc was split


def test_a_module_kept_whole_is_not_split() -> None:
    """``enc`` is split when free (above); named in ``whole`` (a module checkpointed as one
    region) it and its children share a partition."""
    plan = auto_plan(nested_profile(), 3, memory_weight=0.0, whole={"enc"})
    assert plan.owner("enc.a") == plan.owner("enc.b") == plan.owner("enc")
    assert plan.modules["enc.a"].placement == "inherited"


# --- real models -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded_profiles() -> dict[str, ModelProfile]:
    return profiles.recorded()


@pytest.fixture(scope="module")
def real_profiles(recorded_profiles: dict[str, ModelProfile]) -> dict[str, ModelProfile]:
    """Our test models' profiles, as recorded (see :mod:`tests.modelparallel.profiles`)."""
    return {name: recorded_profiles[name] for name in profiles.OURS}


def test_the_recorded_profiles_are_those_of_todays_models(
    recorded_profiles: dict[str, ModelProfile],
) -> None:
    pytest.importorskip("transformers")
    for name, live in profiles.measure().items():
        assert profiles.untimed(live) == profiles.untimed(recorded_profiles[name]), (
            f"{name} no longer profiles as recorded: python -m tests.modelparallel.profiles"
        )


@pytest.mark.parametrize("model", ["grouped", "lm", "branchy", "t5like", "albertlike"])
@pytest.mark.parametrize("partitions", [2, 4])
@pytest.mark.parametrize("memory_weight", [0.2, 1.0])
def test_real_models_get_valid_plans(
    real_profiles: dict[str, ModelProfile], model: str, partitions: int, memory_weight: float
) -> None:
    profile = real_profiles[model]
    plan = auto_plan(profile, partitions, memory_weight=memory_weight)
    assert set(plan.owners) == set(profile.modules)
    assert all(0 <= owner < partitions for owner in plan.owners.values())
    assert plan.owner("") == 0
    for name, stats in profile.modules.items():
        if stats.parent is not None and stats.calls == 0:
            assert plan.owner(name) == plan.owner(stats.parent), name
        if plan.modules[name].placement == "inherited" and stats.parent is not None:
            assert plan.owner(name) == plan.owner(stats.parent), name
    for group in profile.tied_groups:
        assert len({plan.owner(name) for name in group}) == 1
    empty = partitions - len(set(plan.owners.values()))
    assert len(plan.warnings) == min(empty, 1)
    assert sum(plan.stage_costs) >= 1.0 - 1e-9  # the whole model, plus any traffic
    assert PartitionPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_lm_on_two_partitions_splits_the_blocks(real_profiles: dict[str, ModelProfile]) -> None:
    plan = auto_plan(real_profiles["lm"], 2, memory_weight=1.0)  # memory: deterministic
    blocks = [plan.owner(f"blocks.{i}") for i in range(4)]
    assert blocks[0] == 0 and blocks[-1] == 1 and blocks == sorted(blocks)
    assert plan.owner("wte") == plan.owner("lm_head") == 0


def test_identical_layers_show_one_time(real_profiles: dict[str, ModelProfile]) -> None:
    plan = auto_plan(real_profiles["lm"], 2, memory_weight=0.2)
    for part in ("", ".attn", ".attn.qkv", ".mlp.fc"):
        times = {plan.modules[f"blocks.{i}{part}"].compute_time for i in range(4)}
        assert len(times) == 1, part
    assert plan.modules["wte"].compute_time != plan.modules["wpe"].compute_time


def blocks_on(plan: PartitionPlan, prefixes: Sequence[str], count: int) -> list[int]:
    """How many of the blocks ``PREFIX0 .. PREFIX{count-1}`` of every prefix each partition has."""
    owners = [plan.owner(f"{prefix}{i}") for prefix in prefixes for i in range(count)]
    assert owners == sorted(owners), "blocks run in order, so the cuts keep them in order"
    return [owners.count(k) for k in range(plan.partitions)]


@pytest.mark.parametrize("memory_weight", [0.2, 1.0])
def test_weights_tied_across_an_encoder_and_a_decoder_do_not_glue_them(
    real_profiles: dict[str, ModelProfile], memory_weight: float
) -> None:
    profile = real_profiles["t5like"]
    tied = ["shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"]
    assert profile.tied_groups == [tied]
    for partitions in (2, 3):
        plan = auto_plan(profile, partitions, memory_weight=memory_weight)
        assert {plan.owner(name) for name in tied} == {0}  # ``shared`` never runs: the root's
        counts = blocks_on(plan, ["encoder.blocks.", "decoder.blocks."], 3)
        assert min(counts) >= 6 // partitions - 1, counts  # both stacks' blocks spread
        assert plan.modules["encoder"].placement == plan.modules["decoder"].placement == "auto"
        assert plan.modules["decoder.embed_tokens"].placement == "tied"
        assert not plan.warnings


@pytest.mark.parametrize("partitions", [2, 3])
@pytest.mark.parametrize("memory_weight", [0.2, 1.0])
def test_a_layer_called_repeatedly_is_never_split(
    real_profiles: dict[str, ModelProfile], partitions: int, memory_weight: float
) -> None:
    profile = real_profiles["albertlike"]
    assert profile.modules["layer"].calls == 4
    plan = auto_plan(profile, partitions, memory_weight=memory_weight)
    inside = [name for name in plan.owners if name.startswith("layer.")]
    assert len(inside) == 8
    assert {plan.owner(name) for name in inside} == {plan.owner("layer")}
    assert {plan.modules[name].placement for name in inside} == {"inherited"}
    assert plan.owner("decoder") == plan.owner("embed")


def jittered(profile: ModelProfile, seed: int, spread: float = 0.3) -> ModelProfile:
    """The profile with every module's times scaled by its own random factor in ``1 ± spread``."""
    rng = random.Random(seed)
    noisy = ModelProfile.from_dict(profile.to_dict())
    for stats in noisy.modules.values():
        forward, backward = rng.uniform(1 - spread, 1 + spread), rng.uniform(1 - spread, 1 + spread)
        stats.forward_time *= forward
        stats.forward_exclusive *= forward
        stats.backward_time *= backward
        stats.backward_exclusive *= backward
    return noisy


@pytest.mark.parametrize(
    ("model", "partitions"),
    [("lm", 2), ("lm", 3), ("albertlike", 2), ("albertlike", 3)],
)
def test_plans_do_not_follow_timing_noise(
    real_profiles: dict[str, ModelProfile], model: str, partitions: int
) -> None:
    profile = real_profiles[model]
    plan = auto_plan(profile, partitions, memory_weight=0.2)
    for seed in range(50):
        noisy = auto_plan(jittered(profile, seed), partitions, memory_weight=0.2)
        assert noisy.owners == plan.owners, f"seed {seed}"
    if model == "lm" and partitions == 2:
        assert blocks_on(plan, ["blocks."], 4) == [2, 2]


def test_one_layer_timed_three_times_too_slow_moves_nothing(
    real_profiles: dict[str, ModelProfile],
) -> None:
    profile = real_profiles["lm"]
    slowed = ModelProfile.from_dict(profile.to_dict())
    for name in ("blocks.1.attn", "blocks.1.mlp.fc"):
        slowed.modules[name].forward_exclusive *= 3
        slowed.modules[name].backward_exclusive *= 3
    for partitions in (2, 3):
        plan = auto_plan(profile, partitions, memory_weight=0.2)
        assert auto_plan(slowed, partitions, memory_weight=0.2).owners == plan.owners


# --- Hugging Face models (tiny configs, random weights, nothing downloaded) -------------------


@pytest.fixture(scope="module")
def hf_profiles(recorded_profiles: dict[str, ModelProfile]) -> dict[str, ModelProfile]:
    """Tiny Hugging Face models' profiles, as recorded (random weights, nothing downloaded)."""
    return {name: recorded_profiles[name] for name in profiles.HUGGING_FACE}


def test_hugging_face_t5_uses_both_partitions(hf_profiles: dict[str, ModelProfile]) -> None:
    plan = auto_plan(hf_profiles["t5"], 2, memory_weight=0.2)
    counts = blocks_on(plan, ["encoder.block.", "decoder.block."], 3)
    assert min(counts) >= 2, counts
    for group in hf_profiles["t5"].tied_groups:
        assert len({plan.owner(name) for name in group}) == 1


def test_hugging_face_albert_keeps_its_shared_layer_whole(
    hf_profiles: dict[str, ModelProfile],
) -> None:
    shared = "albert.encoder.albert_layer_groups.0"
    assert hf_profiles["albert"].modules[shared].calls == 4
    plan = auto_plan(hf_profiles["albert"], 2, memory_weight=0.2)
    assert {plan.owner(name) for name in plan.owners if name.startswith(shared)} == {
        plan.owner(shared)
    }


@pytest.mark.parametrize("model", ["albert", "gpt2"])
def test_hugging_face_plans_do_not_follow_timing_noise(
    hf_profiles: dict[str, ModelProfile], model: str
) -> None:
    profile = hf_profiles[model]
    plan = auto_plan(profile, 2, memory_weight=0.2)
    for seed in range(50):
        noisy = auto_plan(jittered(profile, seed), 2, memory_weight=0.2)
        assert noisy.owners == plan.owners, f"seed {seed}"
    if model == "gpt2":
        assert blocks_on(plan, ["transformer.h."], 4) == [2, 2]


# --- reading the plan ------------------------------------------------------------------------


def test_table_lists_every_module_and_every_partition() -> None:
    plan = auto_plan(nested_profile(), 3, memory_weight=0.0)
    table = plan.table()
    lines = table.splitlines()
    assert lines[0].split() == [
        "module", "type", "placement", "part", "params", "compute", "ms", "memory", "cost",
    ]  # fmt: skip
    assert lines[1].startswith("(root)")
    assert any(
        line.split()[:4] == ["x", "Tx", "inherited", str(plan.owner("small"))] for line in lines
    )
    slowest_line = next(line for line in lines if line.startswith("slowest partition"))
    assert f"slowest partition: {plan.slowest_stage} " in slowest_line
    assert plan.stages[plan.slowest_stage].time == max(stage.time for stage in plan.stages)


def test_dot_colours_each_module_as_its_partition() -> None:
    plan = auto_plan(nested_profile(), 3, memory_weight=0.0)
    dot = plan.to_dot()
    assert dot.startswith("digraph partition_plan {") and dot.rstrip().endswith("}")
    legend = dict(re.findall(r'  p(\d+) \[label="partition \d+[^"]*", fillcolor="([^"]+)"\]', dot))
    assert len(legend) == 3 and len(set(legend.values())) == 3
    nodes = re.findall(r'  (m\d+) \[label="([^\\"]+)\\n[^"]*", fillcolor="([^"]+)"\]', dot)
    shown = {label: colour for _, label, colour in nodes}
    assert set(shown) == {
        name or "(root)" for name, m in plan.modules.items() if m.placement != "inherited"
    }
    for label, colour in shown.items():
        name = "" if label == "(root)" else label
        assert colour == legend[str(plan.owner(name))], label
    ids = {label: node for node, label, _ in nodes}
    assert f"  {ids['enc']} -> {ids['enc.a']};" in dot
    assert f"  {ids['(root)']} -> {ids['blocks.0']};" in dot  # through the inherited list


def test_owner_of_an_unknown_module() -> None:
    plan = auto_plan(chain([1]), 1, memory_weight=0.0)
    with pytest.raises(PartitionError, match="'nope' is not in the partition plan"):
        plan.owner("nope")


def test_costed_plan_needs_every_module() -> None:
    with pytest.raises(PartitionError, match="no partition to modules"):
        costed_plan(chain([1, 1]), 2, {"": 0, "m0": 1}, memory_weight=0.0)


# --- manual placement ------------------------------------------------------------------------


def test_manual_plan_inherits_from_the_parent() -> None:
    model = ResidualTransformerLM()
    fixed = {"blocks.2": 1, "blocks.3": 1, "blocks.3.mlp": 2}
    plan = manual_plan(model, 3, fixed=fixed, default_partition=0)
    assert plan.owner("") == 0 and plan.owner("wte") == 0 and plan.owner("blocks") == 0
    assert plan.owner("blocks.2.attn.qkv") == 1
    assert plan.owner("blocks.3.attn") == 1
    assert plan.owner("blocks.3.mlp") == plan.owner("blocks.3.mlp.fc") == 2
    assert plan.modules["blocks.3.mlp"].placement == "manual"
    assert plan.modules["blocks.3.mlp.fc"].placement == "inherited"
    assert not plan.profiled and " - " in plan.table()
    assert plan.stages[1].memory_bytes > 0 and plan.stages[1].compute_time == 0


def test_manual_plan_default_partition_and_fixed_root() -> None:
    model = GroupedNet()
    plan = manual_plan(model, 2, fixed={}, default_partition=1)
    assert set(plan.owners.values()) == {1}
    plan = manual_plan(model, 2, fixed={"": 0, "group2": 1}, default_partition=1)
    assert plan.owner("group1.conv1") == 0 and plan.owner("group2.fc2") == 1


def test_manual_plan_rejects_split_tied_modules() -> None:
    with pytest.raises(
        PartitionError, match=r"'wte' \(partition 0\) and 'lm_head' \(partition 1\)"
    ):
        manual_plan(ResidualTransformerLM(), 2, fixed={"lm_head": 1}, default_partition=0)


@pytest.mark.parametrize(
    ("fixed", "default", "message"),
    [
        ({}, 2, "default_partition is 2, but there are 2 partitions: allowed 0..1"),
        ({"group1": 5}, 0, "module 'group1' is placed on partition 5"),
        ({"gruop2": 1}, 0, "there is no module 'gruop2' in the model to place "
                           "(did you mean 'group2'?)"),
    ],
)  # fmt: skip
def test_manual_plan_errors(fixed: dict[str, int], default: int, message: str) -> None:
    with pytest.raises(PartitionError, match=re.escape(message)):
        manual_plan(GroupedNet(), 2, fixed=fixed, default_partition=default)

"""Pipelines x tensor parallelism: pp=2 x tp=2 (world 4, two microbatches) trains like one
process (losses and parameters), every rank running its plan row in every step. Under the
default placement (tp peers are neighbours; automatic partition: rank 0's tp group profiles
together): a plain model marked with smp.set_tensor_parallelism, and
smp.nn.DistributedTransformerLMHead created without memory, split over the stages (its region
scatters the batch on partition 0 after its last layer on partition 1: route 0 -> 1 -> 0; the
plan splits partition 1's backwards), and that LM with a head of its own and its layers
checkpointed (GPT-NeoX's translation in AWS's script: the head stays with the root's code, and
partition 1's recomputed layers run whole backwards, as planned), and a model registering its
head before the blocks it calls first (the planner keeps their Sequential whole, which a cut
would return to before the head). Under ``spread`` (tp peers
are ranks 0 and 2; manual placement): a chain of smp.nn transformer layers, an LM whose head
is tied to its embedding with its blocks marked, and a 4-layer LM head with two consecutive
layers on partition 1. Every rank seeds its generator with a seed of its own: a dropout outside
the regions (in the step body) draws, and the steps leave, the rank's own stream, as far on as
its tp peer's, never a region's (whose seed the group shares; an LM head's region waits for
partition 1 while the next microbatch's region begins).
Another stage's shards hold no elements; a profiling step failing on rank 0's tp peer fails
every rank, naming it. A region entered for a caller on another partition does not gather.
Without processes: a split block cut by the partition fails naming it, the scaled-batch mark
travels with a request's compute mode, the tp styles' hooks are neither replayed nor run where
their module does not compute, and a swapped module keeps the manual partition of the one it
replaced."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import dtrain.modelparallel as smp
from dtrain.modelparallel.api import placement
from dtrain.modelparallel.errors import ModelParallelError, PartitionError
from dtrain.modelparallel.modules import hooks, modes
from dtrain.modelparallel.pipeline.hooks import hooked_submodules
from dtrain.modelparallel.tensor import shards
from dtrain.modelparallel.tensor.batch import scaled_batch
from tests.modelparallel.harness import run_ranks
from tests.modelparallel.models import ResidualTransformerLM
from tests.modelparallel.pipeline.test_deterministic import _collapsed
from tests.modelparallel.tensor.test_equivalence import (
    LM,
    STEPS,
    _lm,
    _lm_loss,
    _mlp,
    _mlp_loss,
    one_process,
    step_of,
    trained,
)


class _Embedded(nn.Module):
    """Token ids to the ``(hidden states, mask)`` pair a transformer layer takes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.table = nn.Embedding(LM["vocab_size"], LM["hidden_size"])

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.table(ids), None


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.score = nn.Linear(LM["hidden_size"], 1)

    def forward(self, pair: tuple[torch.Tensor, Any]) -> torch.Tensor:
        return self.score(pair[0]).squeeze(-1)


def _layers() -> nn.Module:
    """smp.nn transformer layers on either stage, in a chain (each its own scaled batch)."""
    sizes = {k: v for k, v in LM.items() if k not in ("num_layers", "vocab_size", "num_positions")}
    layers = [smp.nn.DistributedTransformerLayer(**sizes) for _ in range(2)]
    return nn.Sequential(_Embedded(), *layers, _Head())


def _layers_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return 0.1 * F.mse_loss(model(ids), mask)  # small steps: the losses fall, as in training


def _tied() -> nn.Module:
    """A plain LM whose head is tied to its embedding, its blocks marked for tp (the head and
    the embedding stay plain: a weight tied across a swap is refused)."""
    model = ResidualTransformerLM(seed=0, vocab=LM["vocab_size"], dim=16, layers=2)
    smp.set_tensor_parallelism(model.blocks)
    return model


def _tied_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids)["loss"]


def _lm4() -> nn.Module:
    """The LM head with four layers: a manual placement puts two consecutive ones on partition
    1, which the transformer's code calls one by one, waiting for each reply in the first step."""
    return smp.nn.DistributedTransformerLMHead(**{**LM, "num_layers": 4})


def _untied_checkpointed() -> nn.Module:
    """The LM head with a head of its own (GPT-NeoX's translation) and its layers checkpointed
    each on its own (AWS's GPT-NeoX script): partitioned automatically, the head stays with the
    root's code, which computes the loss from its logits."""
    module = smp.nn.DistributedTransformerLMHead(**LM, tie_word_embeddings=False)
    smp.set_activation_checkpointing(module.transformer.seq_layers, strategy="each")
    return module


class _HeadFirst(nn.Module):
    """Its head registered before the blocks it runs after (both marked for tp), the blocks in
    an ``nn.Sequential``, whose code runs around them: a plan cutting them returns to the
    Sequential's partition before the head, which no plan order serves, so the automatic
    partition keeps them whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.head = nn.Linear(8, 8)
        self.table = nn.Embedding(32, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        for marked in (self.head, self.blocks):
            smp.set_tensor_parallelism(marked)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.table(ids))).flatten(1)


def _marked_mlp() -> nn.Module:
    module = _mlp()
    smp.set_tensor_parallelism(module)
    return module


CASES = {
    "mlp": (_marked_mlp, _mlp_loss, ("3", "4")),
    "head_first": (_HeadFirst, _mlp_loss, ()),
    "layers": (_layers, _layers_loss, ("2", "3")),
    "tied": (_tied, _tied_loss, ("blocks.1", "ln_f")),
    "lm4": (_lm4, _lm_loss, ("transformer.seq_layers.2", "transformer.seq_layers.3")),
    "delayed": (_lm, _lm_loss, ()),
    "untied": (_untied_checkpointed, _lm_loss, ()),
}
"""Each model, its loss and the modules a manual placement puts on partition 1. The LMs come
back to partition 0 (route 0 -> 1 -> 0): the LM head's region scatters the batch there after
its last layer, and the tied head computes there last. ``delayed`` is the LM head created
without memory (its split modules are made when wrapped, the rest at the first step), which
the planner profiles on the meta device."""

ROUTED = ("tied", "lm4", "delayed", "untied")

OWN_SEED = 1000
"""Each rank seeds its generator with this plus its rank before training."""


def _dropping_outside(
    loss_fn: Callable[..., torch.Tensor], states: list[torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """``loss_fn`` after a dropout outside the tensor-parallel regions, on partition 0 (in the
    step body: microbatch 1's runs while microbatch 0's region waits for partition 1), which
    records the generator's state it draws from in ``states``. Its mask is not used, so the
    losses stay one process's."""

    def dropping(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        states.append(torch.get_rng_state())
        F.dropout(torch.ones(ids.shape[0], 16), 0.5)
        return loss_fn(model, ids, mask)

    return dropping


def _train(case: str, auto: bool) -> dict[str, Any]:
    build, loss_fn, second = CASES[case]
    with smp.delay_param_initialization(enabled=case == "delayed"):
        module = build()
    if not auto:  # the MLP's Linear is swapped when wrapped: it keeps its partition
        for name in second:
            smp.set_partition(module.get_submodule(name), 1)
    model = smp.DistributedModel(module)
    orders: list[list[str]] = []

    def record_order() -> None:
        events = sorted(model.timeline(), key=lambda e: e.start)
        orders.append(_collapsed([(e.kind, e.microbatch, e.visit) for e in events]))

    seed = OWN_SEED + smp.rank()  # every rank its own generator, as independent ranks have
    torch.manual_seed(seed)
    states: list[torch.Tensor] = []
    losses, _ = trained(model, _dropping_outside(loss_fn, states), record_order)
    states.append(torch.get_rng_state())
    plan = model.partition_plan()
    schedule = model.pipeline_schedule()
    mine = {id(p) for p in model.local_parameters()}
    others = [p for p in model.parameters() if id(p) not in mine and isinstance(p, DTensor)]
    return {
        "losses": losses,
        "params": model.state_dict(),
        "split": sum(isinstance(p, DTensor) for p in model.local_parameters()),
        "others": (len(others), sum(p.to_local().numel() for p in others)),
        "owners": {name: plan.owner(name) for name, _ in module.named_children()},
        "blocks": {plan.owner(name) for name, _ in module.named_modules() if "blocks" in name},
        "second": [name for name, _ in module.named_modules() if name and plan.owner(name)],
        "orders": orders,
        "plan": _collapsed(list(schedule.plan_row(smp.pp_rank()))),
        "printed": str(schedule),
        "drawn": _drawn(seed, states),
    }


def _drawn(seed: int, states: list[torch.Tensor], most: int = 20_000) -> list[int | None]:
    """How many 32-bit words a generator seeded with ``seed`` had drawn at each of ``states``
    (in the order they were taken; ``None`` for those no draw of its stream reaches)."""
    generator = torch.Generator().manual_seed(seed)
    drawn: list[int | None] = []
    words = 0
    for state in states:
        while words < most and not torch.equal(generator.get_state(), state):
            torch.randint(2**31, (1,), generator=generator)  # one word
            words += 1
        drawn.append(words if words < most else None)
    return drawn


WORLDS = {
    "cluster": ("mlp", "delayed", "untied", "head_first"),
    "spread": ("layers", "tied", "lm4"),
}
"""The cases each placement's world trains: the automatic plan under ``cluster``, the manual one
under ``spread``."""


def _on_ranks(placement: str) -> dict[str, Any]:
    auto = placement == "cluster"
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "tensor_parallel_degree": 2,
            "ddp": True,
            "microbatches": 2,
            "placement_strategy": placement,
            "auto_partition": auto,
            "default_partition": 0,
        }
    )
    out: dict[str, Any] = {"groups": (smp.get_tp_group(), smp.get_pp_group())}
    for case in WORLDS[placement]:
        out[case] = _train(case, auto)
        smp.reset()
    return out


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_pipeline_by_tensor_parallel_training_equals_one_process(placement: str) -> None:
    """Each case trains to the one-process losses and parameters; every rank computes its plan
    row in every step, a tied head's second visit to partition 0 included, so the ranks of a
    tp group meet in their collectives in one order."""
    ranks = run_ranks(4, _on_ranks, placement, timeout=180)
    auto = placement == "cluster"
    peers = {"cluster": ([0, 1], [0, 2]), "spread": ([0, 2], [0, 1])}[placement]
    assert ranks[0]["groups"] == peers
    tp_groups = ([0, 1], [2, 3]) if auto else ([0, 2], [1, 3])
    for case in WORLDS[placement]:
        build, loss_fn, second = CASES[case]
        losses, params, _ = one_process(build, loss_fn)
        for group in tp_groups:
            # a tp group is one stage of two pipelines: their loss is the mean of its rows'
            mean = [sum(ranks[r][case]["losses"][step] for r in group) / 2 for step in range(STEPS)]
            assert mean == pytest.approx(losses, rel=1e-5)
            assert ranks[group[0]][case]["plan"] == ranks[group[1]][case]["plan"]
        for index, rank in enumerate(ranks):
            got = rank[case]
            assert got["owners"] == ranks[0][case]["owners"]
            # Every step of a route: the second visits are where tp peers could diverge. A
            # chain's first step sends one request per module (the grouping of calls is learnt
            # in it), so a backward shows as several B and I actions there.
            routed = case in ROUTED
            assert all(order == got["plan"] for order in got["orders"][0 if routed else 1 :])
            if not auto:
                assert set(second) <= set(got["second"])
            if case == "head_first":  # the plan follows timings: its plain table may sit alone
                marked = {got["owners"]["head"], got["owners"]["blocks"]}
                assert (got["split"] > 0) == (index // 2 in marked)  # cluster: stage index // 2
            else:
                assert got["split"] > 0  # every stage holds shards
            assert got["others"][1] == 0  # the other stage's shards: empty DTensors, freed
            assert got["others"][0] > 0 or auto
            # Outside the regions (at each dropout there, and after the steps) a rank draws
            # from its own seed's stream, never from a region's, whose seed its tp peer shares:
            # as far on in it as its peer is in its own.
            group = next(group for group in tp_groups if index in group)
            assert None not in got["drawn"]
            assert got["drawn"] == ranks[sum(group) - index][case]["drawn"]
            assert got["params"].keys() == params.keys()
            for key, value in params.items():
                torch.testing.assert_close(got["params"][key], value, rtol=1e-4, atol=1e-6)
        if case == "head_first":  # the blocks and their Sequential on one partition
            owners = ranks[0][case]["owners"]
            assert owners["head"] == 1 and "route" not in ranks[0][case]["printed"]
            assert ranks[0][case]["blocks"] == {owners["blocks"]}
        elif routed:  # back to partition 0: a plan per visit
            assert "route 0 -> 1 -> 0" in ranks[0][case]["printed"]
            assert {"F0.1", "B0.1"} <= set(ranks[0][case]["plan"])
        else:
            assert list(ranks[0][case]["owners"].values())[-1] == 1
        if case == "delayed":  # planned from operation counts: partition 1's backwards split
            assert any(action.startswith("W") for action in ranks[2][case]["plan"])
        if case == "untied":  # the head with the root; recomputed layers run whole backwards
            assert ranks[0][case]["owners"]["lm_head"] == 0
            assert ranks[2][case]["owners"]["transformer"] == 0
            assert "transformer.seq_layers.1" in ranks[2][case]["second"]
            assert not any(action.startswith("W") for action in ranks[2][case]["plan"])


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        setattr(self, shards.SPLIT_BLOCK, True)


def test_a_split_block_cut_by_the_partition_fails_naming_both_partitions() -> None:
    root = nn.Sequential(nn.Linear(2, 2), _Split())
    same = {"": 0, "0": 0, "1": 1, "1.inner": 1}
    shards.check_partition(root, same.__getitem__)
    cut = {**same, "1.inner": 0}
    with pytest.raises(ModelParallelError) as caught:
        shards.check_partition(root, cut.__getitem__)
    assert str(caught.value) == (
        "smp.DistributedModel: module '1' (_Split) is split over the tensor-parallel group and "
        "runs whole on one pipeline partition, but its submodule '1.inner' (Linear) is placed "
        "on partition 0 and it on 1; allowed: the same partition"
    )
    assert shards.split_blocks(root) == {"1"}


def test_the_scaled_batch_mark_travels_with_the_compute_mode() -> None:
    assert not modes.ComputeMode.current().tensor_region
    with modes.tensor_region():
        mode = modes.ComputeMode.current()
    assert mode.tensor_region and not modes.in_tensor_region()
    assert modes.ComputeMode.from_wire(mode.to_wire()) == mode
    seen: list[bool] = []

    def work() -> None:
        with mode.applied():
            seen.append(modes.in_tensor_region())
        seen.append(modes.in_tensor_region())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [True, False]


def _regions() -> tuple[list[int], list[int]]:
    """The rows a region gathers when entered here, and when entered on behalf of a caller on
    another partition (its request's compute mode marks it inside a region)."""
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    rows = torch.full((2, 3), float(smp.rank()))
    with scaled_batch("here", rows) as region:
        here = region.gather(rows)[:, 0].int().tolist()
    with modes.ComputeMode(tensor_region=True).applied(), scaled_batch("called", rows) as region:
        called = region.gather(rows)[:, 0].int().tolist()
    return here, called


def test_a_region_called_from_another_partition_does_not_gather_again() -> None:
    for rank, (here, called) in enumerate(run_ranks(2, _regions)):
        assert here == [0, 0, 1, 1]
        assert called == [rank, rank]


def test_hooks_marked_local_are_not_replayed_and_dropped_where_not_computed() -> None:
    layer = nn.Linear(2, 2)
    style = layer.register_forward_pre_hook(lambda module, args: None)
    assert hooked_submodules("", [("layer", layer)]) == ["layer"]
    hooks.run_where_computed(layer, {style.id})
    assert hooked_submodules("", [("layer", layer)]) == []
    user = layer.register_forward_hook(lambda module, args, out: None)
    assert hooked_submodules("", [("layer", layer)]) == ["layer"]
    hooks.drop_local_hooks(layer)
    assert list(layer._forward_pre_hooks) == [] and list(layer._forward_hooks) == [user.id]


def test_a_swapped_module_keeps_the_partition_of_the_one_it_replaced() -> None:
    root = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    smp.set_partition(root[1], 1)
    placed = placement.manual_placements(root)
    root[1] = nn.Sequential(nn.Linear(2, 2))  # as the swap puts a distributed module there
    assert placement.manual_placements(root) == {}
    placement.keep_placements(root, placed, {"": root, "0": root[0], "1": nn.Linear(2, 2)})
    assert placement.manual_placements(root) == {"1": 1, "1.0": 1}
    placement.clear()


class _Hf(nn.Module):
    """As a Hugging Face model: an embedding, then layers in a list named ``h``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(4, 2)
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(2, 2)) for _ in range(3))


class _Swapped(nn.Module):
    """What a swap makes of ``_Hf``: the layers under another name."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(4, 2)
        self.seq_layers = nn.Sequential(*(nn.Linear(2, 2) for _ in range(3)))


@pytest.mark.parametrize(
    ("placed", "kept"),
    [
        ({"h.1": 1, "h.2": 1}, {"seq_layers.1": 1, "seq_layers.2": 1}),
        ({"h": 1}, {"seq_layers": 1, **{f"seq_layers.{i}": 1 for i in range(3)}}),
        (
            {"": 1},
            {"": 1, "embedding": 1, "seq_layers": 1, **{f"seq_layers.{i}": 1 for i in range(3)}},
        ),
        ({"wte": 1}, "'wte' on partition 1"),
        (
            {"h.1": 1, "h.1.0": 0},
            "'h.1.0' on partition 0 before [^;]* \\(under 'h.1', on partition 1\\)",
        ),
    ],
)
def test_placements_on_a_swapped_model_follow_its_layers_or_fail_naming_them(
    placed: dict[str, int], kept: dict[str, int] | str
) -> None:
    # GPT-2's transformer.h.2 is the translated LM head's transformer.seq_layers.2.
    old, new = _Hf(), _Swapped()
    for name, partition in placed.items():
        smp.set_partition(old.get_submodule(name), partition, recurse=False)
    before = dict(old.named_modules())
    try:
        if isinstance(kept, str):
            with pytest.raises(PartitionError, match=f"placed module {kept}"):
                placement.keep_placements(new, placement.manual_placements(old), before)
        else:
            placement.keep_placements(new, placement.manual_placements(old), before)
            assert placement.manual_placements(new) == kept
    finally:
        placement.clear()


class _FailsOnTpRank1(nn.Module):
    """Raises in its first forward (the profiling step) on tp rank 1 only."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1 and smp.tp_rank() == 1:
            raise ValueError("broken on tp rank 1")
        return x


def _profiling_fails_on_a_tp_peer() -> tuple[str, str]:
    smp.init(
        {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 2}
    )
    model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 4), _FailsOnTpRank1(), nn.Linear(4, 1)))
    with pytest.raises(Exception) as failed:
        step_of(lambda m, x, y: F.mse_loss(m(x), y))(model, torch.ones(4, 4), torch.ones(4, 1))
    return type(failed.value).__name__, str(failed.value)


def test_a_profiling_step_failing_on_a_tp_peer_fails_every_rank_naming_it() -> None:
    """Rank 0's tp peer profiles with it: its failure reaches rank 0's broadcast, not a hang."""
    ranks = run_ranks(4, _profiling_fails_on_a_tp_peer, timeout=40)
    assert ranks[1] == ("ValueError", "broken on tp rank 1")
    for kind, message in [ranks[0], *ranks[2:]]:
        assert kind == "StepFailedError"
        assert "ValueError: broken on tp rank 1 (raised on rank 1;" in message

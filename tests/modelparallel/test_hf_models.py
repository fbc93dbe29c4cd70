"""Hugging Face ``transformers`` models (GPT-2, BERT, Llama, T5) split across pipeline ranks train
like one process on the same global batch.

Tiny configs, random weights, nothing downloaded (see :mod:`tests.modelparallel.hf_cases`).
4 SGD steps; losses agree to a relative 1e-5 and every final parameter to 1e-5 (absolute); in
float64, every parameter to a relative 1e-12. Several layouts share one world to keep the file
fast.
"""

from __future__ import annotations

import pytest
import torch

from tests.modelparallel.harness import run_ranks
from tests.modelparallel.hf_cases import (
    HF_ENV,
    Layout,
    Trained,
    pipelined_attentions,
    reference,
    reference_attentions,
    train_layouts,
)
from tests.modelparallel.test_equivalence import assert_equivalent

pytest.importorskip("transformers")

STEPS = 4


def _train(world_size: int, layouts: list[Layout]) -> list[list[Trained | None]]:
    return run_ranks(world_size, train_layouts, layouts, STEPS, timeout=240, env=HF_ENV)


def test_gpt2_with_padding_every_schedule() -> None:
    """GPT-2 LM with ``attention_mask`` (right padding) and ``labels`` (-100 on the padding),
    the second half of ``transformer.h`` and ``ln_f`` on partition 1; the tied ``wte``/``lm_head``
    stay together on partition 0."""
    layouts = [
        Layout("gpt2", pipeline, microbatches)
        for pipeline in ("simple", "interleaved")
        for microbatches in (2, 4)
    ]
    rank0, _ = _train(2, layouts)
    expected = reference("gpt2", STEPS)
    for layout, got in zip(layouts, rank0, strict=True):
        assert got is not None
        assert_equivalent(got, expected, str(layout))


ONE_WORLD = {
    "bert": Layout("bert", "simple", 2),
    "llama": Layout("llama", "interleaved", 4),
    "t5": Layout("t5", "interleaved", 2, float64=True),
    "t5_auto": Layout("t5", "interleaved", 2, auto=True, float64=True),
}
"""Layouts trained in one world: BERT, Llama, and T5 split by hand and by the automatic plan."""


@pytest.fixture(scope="module")
def one_world() -> dict[str, Trained]:
    rank0, _ = _train(2, list(ONE_WORLD.values()))
    return dict(zip(ONE_WORLD, rank0, strict=True))


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_bert_masked_lm_and_llama(one_world: dict[str, Trained], name: str) -> None:
    """BERT masked LM (labels -100 off the masked positions; the tied MLM decoder stays on
    partition 0 with the embeddings) and a 4-layer Llama causal LM."""
    layout = ONE_WORLD[name]
    assert_equivalent(one_world[name], reference(layout.case, STEPS), str(layout))


FLOAT64_TOLERANCE = 1e-12
"""Relative, per parameter and loss, in float64: rounding leaves ~1e-16 after 4 steps; a gradient
lost, counted twice or split wrongly leaves 1e-6 and more."""


def assert_same_in_float64(got: Trained, expected: Trained, what: str) -> None:
    """Losses and every parameter agree to :data:`FLOAT64_TOLERANCE`, relative."""
    losses, reference_losses = torch.tensor(got.losses), torch.tensor(expected.losses)
    relative = ((losses - reference_losses).abs() / reference_losses.abs()).max().item()
    assert relative <= FLOAT64_TOLERANCE, f"{what}: losses {got.losses} vs {expected.losses}"
    assert got.params.keys() == expected.params.keys(), what
    for name, value in expected.params.items():
        assert got.params[name].dtype == torch.float64, f"{what}: {name} is not float64"
        diff = ((got.params[name] - value).norm() / value.norm()).item()
        assert diff <= FLOAT64_TOLERANCE, f"{what}: parameter {name} differs by {diff:.3g}"


@pytest.mark.parametrize("name", ["t5", "t5_auto"])
def test_t5_trains_like_one_process_in_float64(one_world: dict[str, Trained], name: str) -> None:
    """T5 split inside its decoder (block 0's position biases, the masks and the encoder's states
    cross partitions), and as the automatic plan splits it (today the decoder on partition 1 calls
    back the shared embedding on partition 0): in float64, where float32's summation order hides
    nothing, the same training as one process on the whole batch."""
    layout, got = ONE_WORLD[name], one_world[name]
    assert got.partitions_used == 2, f"{layout}: the model was not split"
    assert_same_in_float64(got, reference("t5", STEPS, layout), str(layout))


def test_gpt2_two_partitions_times_two_replicas() -> None:
    layout = Layout("gpt2", "interleaved", 2)
    results = _train(4, [layout])
    leaders = [r[0] for r in results if r[0] is not None]
    assert len(leaders) == 2, "one pipeline leader per data-parallel replica"
    # Each replica saw half the batch (as many labelled tokens as the other): the global loss is
    # the mean of the two.
    losses = [sum(pair) / 2 for pair in zip(*(t.losses for t in leaders), strict=True)]
    expected = reference("gpt2", STEPS)
    for trained in leaders:
        assert_equivalent(Trained(losses, trained.params), expected, str(layout))


def test_auto_partition_splits_hf_models() -> None:
    layouts = [Layout(case, "interleaved", 2, auto=True) for case in ("gpt2", "llama")]
    rank0, _ = _train(2, layouts)
    for layout, got in zip(layouts, rank0, strict=True):
        assert got is not None
        assert got.partitions_used == 2, f"{layout}: the automatic plan did not split the model"
        assert_equivalent(got, reference(layout.case, STEPS), str(layout))


CHECKPOINTING = {"reentrant": True, "non_reentrant": False}


@pytest.fixture(scope="module")
def checkpointed() -> dict[str, Trained]:
    """Split GPT-2 trained with HF activation checkpointing, each ``use_reentrant`` setting, and
    without it, in one world."""
    layouts = [Layout("gpt2", "interleaved", 2, checkpointing=v) for v in CHECKPOINTING.values()]
    layouts.append(Layout("gpt2", "interleaved", 2))
    rank0, _ = _train(2, layouts)
    return dict(zip([*CHECKPOINTING, "off"], rank0, strict=True))


@pytest.mark.parametrize("setting", sorted(CHECKPOINTING))
def test_gpt2_activation_checkpointing_trains_like_one_process(
    checkpointed: dict[str, Trained], setting: str
) -> None:
    """HF gradient checkpointing on a split GPT-2: the same training as one process with the same
    setting."""
    layout = Layout("gpt2", "interleaved", 2, checkpointing=CHECKPOINTING[setting])
    assert_equivalent(checkpointed[setting], reference("gpt2", STEPS, layout), str(layout))


@pytest.mark.parametrize("setting", ["reentrant", "non_reentrant"])
def test_gpt2_activation_checkpointing_recomputes_once(
    checkpointed: dict[str, Trained], setting: str
) -> None:
    """Every layer runs its forward once per microbatch without checkpointing and twice with it
    (the recomputation in the backward), on either partition, as in one process."""
    forwards = STEPS * 2
    assert checkpointed["off"].extra["attention_calls"] == [forwards] * 4
    assert checkpointed[setting].extra["attention_calls"] == [2 * forwards] * 4


def test_gpt2_output_attentions_across_partitions() -> None:
    """A forward-only step with ``output_attentions=True`` on a split GPT-2 returns all 4 layers'
    attention maps (two of them computed on partition 1), equal to one process's."""
    rank0, _ = run_ranks(
        2, pipelined_attentions, Layout("gpt2", "interleaved", 2), timeout=240, env=HF_ENV
    )
    expected = reference_attentions("gpt2")
    assert rank0 is not None
    assert len(rank0) == len(expected) == 4
    for layer, (got, want) in enumerate(zip(rank0, expected, strict=True)):
        assert got.shape == want.shape, f"layer {layer}"
        diff = (got - want).abs().max().item()
        assert diff <= 1e-6, f"attention map of layer {layer} differs by {diff:.3g}"


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_bf16_autocast_inside_the_step(case: str) -> None:
    """``torch.autocast("cpu", dtype=torch.bfloat16)`` inside the step applies on every partition.

    The reference runs the same two microbatches one after another in one process (averaging
    their gradients): bf16 matmuls round differently for a batch of 8 rows than for two of 4
    (CPU GEMM blocking changes the fp32 accumulation order, and bf16 keeps 8 bits), so the
    whole-batch reference differs by ~1e-4, as much as fp32 training does. Against the
    microbatched reference the tolerance stays 1e-5.
    """
    layout = Layout(case, "interleaved", 2, bf16=True)
    rank0, _ = _train(2, [layout])
    got = rank0[0]
    assert got is not None
    assert_equivalent(got, reference(case, STEPS, layout, microbatches=2), str(layout))
    # And autocast really was on: fp32 training ends measurably elsewhere.
    fp32 = reference(case, STEPS)
    drift = max((got.params[k] - v).abs().max().item() for k, v in fp32.params.items())
    assert drift > 1e-5, f"bf16 training matches fp32 training to {drift:.3g}: autocast was off"

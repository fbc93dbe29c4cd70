"""SMP's fp16 switches of ``smp.nn`` attention, in one process: with bf16 activations
``attention_in_fp32`` multiplies queries and keys in fp32 and ``query_key_layer_scaling`` scales
the scores down by the layer's number and back in fp32, both with the softmax in fp32; the
probabilities come closer to fp32's than bf16's own, and are those without the layer scaling.
In fp32 neither changes the computation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtrain.modelparallel as smp
from tests.modelparallel.harness import single_process

LAYER = {
    "num_attention_heads": 2,
    "attention_head_size": 16,
    "hidden_size": 32,
    "attention_dropout_prob": 0.0,
    "hidden_dropout_prob": 0.0,
    "causal_mask_size": 8,
    "layer_idx": 5,
}
SWITCHES = {
    "none": {},
    "fp32": {"attention_in_fp32": True},
    "scaling": {"query_key_layer_scaling": True},
    "both": {"attention_in_fp32": True, "query_key_layer_scaling": True},
}


class _Dtypes(TorchDispatchMode):
    """Records the dtypes of the attention's products (``bmm``: the scores' and the values')
    and its softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = {"bmm": set(), "_softmax": set()}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = func.overloadpacket.__name__
        if name in self.seen:
            self.seen[name].add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    with single_process({}):
        yield


def _layer(dtype: torch.dtype, switches: dict[str, bool]) -> smp.nn.DistributedAttentionLayer:
    torch.manual_seed(0)
    return smp.nn.DistributedAttentionLayer(**LAYER, **switches).to(dtype).eval()


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("switches", "dtype", "scores", "softmax", "values"),
    [
        ("none", BF16, None, None, None),  # SDPA, no score matrix of its own
        ("fp32", BF16, F32, F32, BF16),
        ("scaling", BF16, BF16, F32, BF16),
        ("both", F16, F32, F32, F16),
        ("both", F32, None, None, None),  # nothing to change in fp32: SDPA
    ],
    ids=["none-bf16", "fp32-bf16", "scaling-bf16", "both-fp16", "both-fp32"],
)
def test_scores_and_softmax_run_in_fp32_when_asked_in_half_precision(
    world: None,
    switches: str,
    dtype: torch.dtype,
    scores: torch.dtype | None,
    softmax: torch.dtype | None,
    values: torch.dtype | None,
) -> None:
    """The scores' product in fp32 with ``attention_in_fp32``, the softmax in fp32 with either
    switch, the values' product in the half type."""
    layer = _layer(dtype, SWITCHES[switches])
    hidden = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad(), _Dtypes() as dtypes:
        out = layer((hidden, None))
    assert out.dtype == dtype
    assert dtypes.seen == {"bmm": {scores, values} - {None}, "_softmax": {softmax} - {None}}


def _queries_keys() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys whose scores reach tens (where bf16 is 0.25 apart), a causal bias."""
    generator = torch.Generator().manual_seed(2)
    query, key = (3 * torch.randn(2, 2, 8, 16, generator=generator) for _ in range(2))
    bias = torch.zeros(8, 8).masked_fill_(~torch.ones(8, 8, dtype=torch.bool).tril(), -1e4)
    return query, key, bias


def test_fp32_switches_bring_bf16_probabilities_to_fp32s(world: None) -> None:
    """``attention_in_fp32`` brings the bf16 probabilities closer to fp32's (measured on the
    same bf16 inputs: 1.9e-3 against bf16's own 3.1e-3), with the scaling too within a rounding
    of bf16, layer 5's scaling undone: the probabilities are those without it."""
    half = [t.to(BF16) for t in _queries_keys()]
    exact = [t.float() for t in half]  # the same inputs: only the computation's rounding counts
    reference = _layer(F32, {}).probabilities(*exact, wide=False)
    errors = {}
    for name in ("none", "fp32", "both"):
        probs = _layer(BF16, SWITCHES[name]).probabilities(*half, wide=name != "none")
        assert probs.dtype == BF16
        errors[name] = (probs.float() - reference).abs().max().item()
    assert errors["both"] < errors["none"]
    assert errors["fp32"] < errors["none"]
    assert errors["both"] <= 2e-3  # half a bf16 step of a probability below 1


def test_layer_scaling_keeps_fp16_scores_in_range(world: None) -> None:
    """Scores whose product passes fp16's largest value (65504): without a switch the fp16
    probabilities are not numbers; with ``query_key_layer_scaling`` (layer 5: scaled down 6
    times more) they are, and sum to 1 as fp32's do."""
    query, key, bias = (t.to(F16) for t in _queries_keys())
    query, key = query * 40, key * 40  # products up to about 1e5
    assert (query.float() @ key.float().mT).abs().max() > 65504
    none = _layer(F16, {}).probabilities(query, key, bias, wide=False)
    scaled = _layer(F16, SWITCHES["scaling"]).probabilities(query, key, bias, wide=True)
    assert not torch.isfinite(none).all()
    assert torch.isfinite(scaled).all()
    torch.testing.assert_close(scaled.float().sum(-1), torch.ones(2, 2, 8), rtol=0, atol=4e-3)


def test_the_switches_reach_each_layer_of_a_transformer(world: None) -> None:
    """Passed to the transformer (as ``smp.tensor_parallelism(**switches)`` passes them), each
    layer's attention takes them, with its own number for the scaling."""
    layers = {key: value for key, value in LAYER.items() if key != "layer_idx"}
    transformer = smp.nn.DistributedTransformer(
        num_layers=3, intermediate_size=64, **layers, **SWITCHES["both"]
    )
    for number, layer in enumerate(transformer.seq_layers, start=1):
        attention = layer.attention
        assert attention.attention_in_fp32 and attention.query_key_layer_scaling
        assert attention.layer_number == number

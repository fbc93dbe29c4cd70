"""smp.nn on two tensor-parallel ranks against the same modules in one process: the same
initial weights (tensor_parallel_seed), outputs, gradients and whole-tensor state dicts that
load both ways, with positional or keyword input; the collectives of a transformer layer's
step; sizes that do not split are named before any step."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import swap
from dtrain.modelparallel.tensor.dtensors import whole
from tests.modelparallel.harness import run_ranks, single_process

LM = {
    "num_layers": 2,
    "num_attention_heads": 4,
    "attention_head_size": 4,
    "hidden_size": 16,
    "intermediate_size": 32,
    "vocab_size": 40,
    "num_positions": 8,
    "attention_dropout_prob": 0.0,
    "hidden_dropout_prob": 0.0,
    "causal_mask_size": 8,
    "pre_layernorm": True,
}
BATCH = 4


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 40, (BATCH, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(BATCH, 8)
    mask[1, 6:] = 0
    return ids, mask


def _run_modules() -> dict[str, Any]:
    """Each rank's own rows through the modules, their backward, and the state dicts."""
    torch.manual_seed(100 + smp.rank())  # the ranks' own generators differ: init must not care
    lm = smp.nn.DistributedTransformerLMHead(**LM)
    linear = smp.nn.DistributedLinear(16, 6)
    embedding = smp.nn.DistributedEmbedding(40, 16, padding_idx=0)
    ids, mask = _inputs()
    rows = BATCH // smp.tp_size()
    mine = slice(smp.tp_rank() * rows, (smp.tp_rank() + 1) * rows)
    loss, logits = lm((ids[mine], mask[mine], None, None, ids[mine]))
    out = linear(embedding(ids[mine]))
    with torch.no_grad():
        keyword = linear(input=embedding(input=ids[mine]))  # nn.Linear's and nn.Embedding's name
    (loss + out.pow(2).mean()).backward()
    modules = {"lm": lm, "linear": linear, "embedding": embedding}
    return {
        "loss": loss.item(),
        "logits": logits.detach(),
        "out": out.detach(),
        "keyword": torch.equal(keyword, out),  # here: an unwaited collective pickles unset
        "state": {name: m.state_dict() for name, m in modules.items()},
        "grads": {
            name: {k: whole(p.grad) for k, p in m.named_parameters()} for name, m in modules.items()
        },
    }


def _layer_collectives() -> tuple[dict[str, int], dict[str, int]]:
    """The collectives of a transformer layer's forward and of its backward, by name."""
    layer = smp.nn.DistributedTransformerLayer(
        **{k: LM[k] for k in ("num_attention_heads", "attention_head_size", "hidden_size")},
        intermediate_size=32,
        causal_mask_size=8,
        pre_layernorm=True,
        post_layernorm=False,
    )
    hidden, mask = torch.randn(2, 8, 16), torch.zeros(2, 1, 1, 8)
    with CommDebugMode() as forward:
        out, _ = layer((hidden, mask))
    with CommDebugMode() as backward:
        out.pow(2).mean().backward()
    counts = [{str(op): n for op, n in c.get_comm_counts().items()} for c in (forward, backward)]
    return counts[0], counts[1]


def _on_two_ranks() -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    result = _run_modules()
    lm = smp.nn.DistributedTransformerLMHead(**LM)
    doubled = {k: v * 2 for k, v in result["state"]["lm"].items()}
    lm.load_state_dict(doubled)  # whole tensors (a plain module's) into the shards
    result["reloaded"] = lm.state_dict()
    errors = []
    for build in (
        lambda: smp.nn.DistributedTransformerLayer(num_attention_heads=3, attention_head_size=4),
        lambda: smp.nn.DistributedTransformerOutputLayer(hidden_size=8, intermediate_size=7),
        lambda: smp.nn.DistributedLinear(5, 4),
        lambda: smp.nn.DistributedEmbedding(10, 9),
        lambda: smp.nn.DistributedEmbedding(10, 8, max_norm=1.0),
        lambda: smp.nn.DistributedAttentionLayer(cross_attention=True),
    ):
        try:
            build()
        except ModelParallelError as exc:
            errors.append(str(exc))
    result["errors"] = errors
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swap.distribute(nn.Sequential(nn.Linear(2, 2)))  # nothing marked
    result["unsplit"] = [str(w.message) for w in caught]
    result["collectives"] = _layer_collectives()
    return result


def test_two_ranks_compute_as_one_process_and_name_sizes_that_do_not_split() -> None:
    ranks = run_ranks(2, _on_two_ranks, timeout=120)
    with single_process({}):
        one = _run_modules()
    assert all(rank["keyword"] for rank in [*ranks, one])
    forward, backward = ranks[0]["collectives"]
    # Forward: the region's seed and shapes, its gathers of the rows and of the mask, the
    # attention's and the feed-forward's row-split sums. Backward: the gather of the rows'
    # gradients, one sum of query's, key's and value's input gradients (not one each), one of
    # dense1's.
    assert forward == {"c10d._allgather_base_": 3, "c10d_functional.all_reduce": 2}
    assert backward == {"c10d._allgather_base_": 1, "c10d_functional.all_reduce": 2}
    for name in ("logits", "out"):
        together = torch.cat([rank[name] for rank in ranks])
        torch.testing.assert_close(together, one[name], rtol=1e-5, atol=1e-6)
    assert sum(rank["loss"] for rank in ranks) / 2 == pytest.approx(one["loss"], rel=1e-5)
    for name, state in one["state"].items():
        for rank in ranks:  # whole tensors, the single process's initial values
            assert state.keys() == rank["state"][name].keys()
            for key, value in state.items():
                assert torch.equal(rank["state"][name][key], value), (name, key)
    assert (
        "tensor_parallel_degree=2, but no module of the model is distributed"
        in (ranks[0]["unsplit"][0])
    )
    for key, value in ranks[0]["reloaded"].items():
        torch.testing.assert_close(value, one["state"]["lm"][key] * 2)
    with single_process({}):  # and the two ranks' state loads into the plain module
        lm = smp.nn.DistributedTransformerLMHead(**LM)
        lm.load_state_dict(ranks[1]["state"]["lm"])
    for name, grads in one["grads"].items():
        for key, grad in grads.items():
            # A split module's gradient covers both ranks' rows (the sum of their losses'), a
            # plain one (the embeddings outside the transformer) its rank's rows.
            split = name != "lm" or key.startswith("transformer.")
            got = ranks[0]["grads"][name][key] / 2 if split else None
            if not split:
                got = (ranks[0]["grads"][name][key] + ranks[1]["grads"][name][key]) / 2
            torch.testing.assert_close(got, grad, rtol=1e-4, atol=1e-6, msg=f"{name} {key}")
    assert ranks[0]["errors"] == [
        "smp.nn.DistributedAttentionLayer: num_attention_heads=3 does not split over "
        "tensor_parallel_degree=2; allowed: a multiple of 2",
        "smp.nn.DistributedTransformerOutputLayer: intermediate_size=7 does not split over "
        "tensor_parallel_degree=2; allowed: a multiple of 2",
        "smp.nn.DistributedLinear: in_features=5 does not split over tensor_parallel_degree=2; "
        "allowed: a multiple of 2",
        "smp.nn.DistributedEmbedding: embedding_dim=9 does not split over "
        "tensor_parallel_degree=2; allowed: a multiple of 2",
        "smp.nn.DistributedEmbedding: max_norm=1.0 is not supported by dtrain; allowed: None",
        "smp.nn.DistributedAttentionLayer: cross_attention=True is not supported by dtrain; "
        "allowed: False",
    ]


SMALL = {key: LM[key] for key in list(LM)[:9]}
"""The LM head's first nine arguments, in SMP's order (every SMP version's)."""


def test_smps_constructor_arguments_are_taken_as_smp_takes_them() -> None:
    """Positional arguments in SMP's order, SMP's keywords (``tie_input_output_embedding``,
    ``final_layernorm``, ``mask_value``) and defaults (``layer_idx`` 0, a single pre-layer
    norm); unknown ones fail naming the module given them."""
    ids, mask = _inputs()
    with single_process({}):
        by_position = smp.nn.DistributedTransformerLMHead(*SMALL.values()).state_dict()
        smp.reset()  # creation numbers from 0 again: the same initial weights
        by_keyword = smp.nn.DistributedTransformerLMHead(**SMALL).state_dict()
        assert by_position.keys() == by_keyword.keys()
        assert all(torch.equal(by_position[key], by_keyword[key]) for key in by_keyword)
        with pytest.raises(TypeError, match=r"LMHead: 1 positional argument\(s\) after 'hidden"):
            smp.nn.DistributedTransformerLMHead(*SMALL.values(), "gelu")
        stack = smp.nn.DistributedTransformer(1, 2, 4, 8, 16, 0.0, 0.0, "relu", 1e-6)
        assert stack.seq_layers[0].output.activation == "relu"
        assert stack.seq_layers[0].attention.pre_layernorm is None  # post_layernorm only
        with pytest.raises(TypeError, match=r"DistributedTransformerLMHead: unexpected .*'bogus'"):
            smp.nn.DistributedTransformerLMHead(**SMALL, bogus=1)
        untied = smp.nn.DistributedTransformerLMHead(**SMALL, tie_input_output_embedding=False)
        assert untied.lm_head.weight is not untied.word_embedding.weight
        normed = smp.nn.DistributedTransformerLMHead(**LM, final_layernorm=True, add_lm_head=False)
        out = normed((ids, mask, None, None, None))
        torch.testing.assert_close(out.mean(-1), torch.zeros(BATCH, 8), atol=1e-5, rtol=0)
        unmasked = smp.nn.DistributedTransformerLMHead(**LM, mask_value=0.0).eval()
        hidden = torch.zeros(BATCH, 8)  # masks every token, with a value of 0: nothing
        torch.testing.assert_close(
            unmasked((ids, hidden, None, None, None)), unmasked((ids, mask, None, None, None))
        )
        layer = smp.nn.DistributedTransformerLayer(
            num_attention_heads=2, attention_head_size=4, hidden_size=8, intermediate_size=16,
            scale_attn_by_layer_idx=True,
        )  # fmt: skip
        assert layer.attention.scale == 4**-0.5  # layer_idx 0
        single = smp.nn.DistributedTransformerLayer(
            num_attention_heads=2, attention_head_size=4, hidden_size=8, intermediate_size=16,
            single_pre_layernorm=True, parallel_attn_output=True, post_layernorm=False,
        )  # fmt: skip
        assert single.attention.pre_layernorm is not None and single.output.pre_layernorm is None
        with pytest.raises(ValueError, match="at least one of pre_layernorm, single_pre_layernorm"):
            smp.nn.DistributedTransformerLayer(post_layernorm=False)

"""Hugging Face models beyond GPT-2 split in place (``tensor/huggingface/inplace.py``) train on two
tensor-parallel ranks like the plain HF model in one process: losses, and the whole parameters
of ``state_dict()``, which loads into the plain model unchanged, as the plain model's loads
into the split one. Tiny configs (2 layers, hidden 32, 4 heads), hf_cases' batches (padded
causal LM, masked LM, T5's sequence to sequence, ViT's images); one spawn trains every model.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.averages import is_scaled_batch
from dtrain.modelparallel.tensor.huggingface import inplace
from dtrain.modelparallel.tensor.huggingface.family import HeadDropout, attention_dropout
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import run_ranks, single_process
from tests.modelparallel.models import seeded

pytest.importorskip("transformers")

STEPS = 2
SIZES = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64}
LAYERS = {"vocab_size": hf_cases.VOCAB, "num_hidden_layers": 2, **SIZES}
GPT = {"n_positions": hf_cases.SEQ, "n_embd": 32, "n_layer": 2, "n_head": 4}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LLAMA = {**LAYERS, "max_position_embeddings": hf_cases.SEQ, "num_key_value_heads": 2}
ENCODER = {**LAYERS, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
T5 = {
    "vocab_size": hf_cases.VOCAB,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "dropout_rate": 0.0,
    "decoder_start_token_id": 0,
}
VIT = {
    **SIZES,
    "num_hidden_layers": 2,
    "image_size": hf_cases.IMAGE[1],
    "patch_size": 4,
    "num_channels": hf_cases.IMAGE[0],
    "num_labels": hf_cases.CLASSES,
}


@dataclass(frozen=True)
class Model:
    kind: str
    """``transformers``' prefix: ``<kind>Config`` and ``<kind>For<head>``."""
    head: str
    config: dict[str, Any]
    batches: str
    """hf_cases' batches: ``gpt2`` (padded causal LM), ``bert`` (masked LM), ``t5``, ``vit``."""
    inside: bool = True
    """Made inside ``smp.tensor_parallelism()``, else marked by ``smp.set_tensor_parallelism``."""
    checkpointed: str | None = None
    """Layers recompute in the backward: ``hf`` (HF's activation checkpointing, non-reentrant)
    or ``smp`` (``smp.set_activation_checkpointing`` on each of ``model.layers``)."""

    def build(self, **changes: Any) -> nn.Module:
        import transformers

        config = getattr(transformers, f"{self.kind}Config")(**{**self.config, **changes})
        kind = getattr(transformers, f"{self.kind}For{self.head}")
        model = seeded(0, lambda: kind._from_config(config, attn_implementation="eager"))
        if self.checkpointed == "hf":
            kwargs = {"use_reentrant": False}
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return model.train()


MODELS = {
    "gptneox": Model(
        "GPTNeoX",
        "CausalLM",
        {**LAYERS, "max_position_embeddings": hf_cases.SEQ, "hidden_dropout": 0.0},
        "gpt2",
    ),
    "llama": Model(
        "Llama",
        "CausalLM",
        LLAMA,
        "gpt2",
    ),
    "llama_checkpointed": Model(
        "Llama",
        "CausalLM",
        LLAMA,
        "gpt2",
        checkpointed="hf",
    ),
    "llama_smp_checkpointed": Model("Llama", "CausalLM", LLAMA, "gpt2", checkpointed="smp"),
    "gptj": Model("GPTJ", "CausalLM", {**GPT, **NO_DROPOUT, "rotary_dim": 4}, "gpt2"),
    "bert": Model("Bert", "MaskedLM", {**ENCODER, "max_position_embeddings": hf_cases.SEQ}, "bert"),
    # Token 1 pads: RoBERTa's positions skip it, so the batches' ids exercise that rule. Weights
    # drawn wider than HF's 0.02 keep attention off uniform, where its dropout barely shows.
    "roberta": Model(
        "Roberta",
        "MaskedLM",
        {**ENCODER, "max_position_embeddings": hf_cases.SEQ + 2, "initializer_range": 0.1},
        "bert",
        inside=False,
    ),
    "gptneo": Model(
        "GPTNeo",
        "CausalLM",
        {
            "max_position_embeddings": hf_cases.SEQ,
            "hidden_size": 32,
            "num_layers": 2,
            "num_heads": 4,
            "attention_types": [[["global", "local"], 1]],
            "window_size": 4,
            "resid_dropout": 0.0,
            "embed_dropout": 0.0,
            "attention_dropout": 0.0,
            "vocab_size": hf_cases.VOCAB,
        },
        "gpt2",
        inside=False,
    ),
    "t5": Model("T5", "ConditionalGeneration", T5, "t5"),
    "t5_gated": Model(
        "T5", "ConditionalGeneration", {**T5, "feed_forward_proj": "gated-gelu"}, "t5", inside=False
    ),
    "vit": Model("ViT", "ImageClassification", VIT, "vit"),
}


def _plain(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = MODELS[name].build()
    optimizer = torch.optim.SGD(model.parameters(), lr=hf_cases.LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(**hf_cases.BATCHES[MODELS[name].batches](step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train(name: str, **changes: Any) -> dict[str, Any]:
    """Model ``name`` (its config with ``changes``) trained on this rank's rows."""
    spec = MODELS[name]
    if spec.inside:  # without memory when the layout delays initialization
        with smp.model_creation(tensor_parallelism=True):
            module = spec.build(**changes)
    else:
        module = spec.build(**changes)
        smp.set_tensor_parallelism(module)
    if spec.checkpointed == "smp":
        for layer in module.model.layers:
            smp.set_activation_checkpointing(layer)
    model = smp.DistributedModel(module)
    unmade = sorted(n for n, p in module.named_parameters() if p.is_meta)
    losses = hf_cases.train_wrapped(model, spec.batches, STEPS)
    split = sum(isinstance(p, DTensor) for p in model.parameters())
    rows = sorted(n for n, p in module.named_parameters() if not is_scaled_batch(p))
    trained = {key: value.clone() for key, value in model.state_dict().items()}
    model.load_state_dict(spec.build().state_dict())  # the plain model's, back in
    reloaded = model.state_dict()
    return {
        "losses": losses,
        "state": trained,
        "split": split,
        "reloaded": reloaded,
        "rows": rows,
        "unmade": unmade,
    }


def _rows() -> slice:
    rows = hf_cases.GLOBAL_BATCH // smp.dp_size()
    return slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)


def _hidden_states() -> tuple[slice, list[torch.Tensor]]:
    """This rank's rows and every layer's hidden states of them (``output_hidden_states``)."""
    with smp.tensor_parallelism():
        model = smp.DistributedModel(MODELS[HIDDEN].build())

    @smp.step
    def forward_step(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(model(**batch, output_hidden_states=True).hidden_states)

    batch = hf_cases.CASES[MODELS[HIDDEN].batches].batch(0)
    with torch.no_grad():
        outputs = forward_step(model, {k: v[_rows()] for k, v in batch.items()})
    return _rows(), [output.concat() for output in outputs]


def _on_ranks() -> dict[str, Any]:
    dist.init_process_group("gloo")
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    out: dict[str, Any] = {}
    for name in MODELS:
        out[name] = _train(name)
        smp.reset()
    for key, (name, changes) in UNSPLIT.items():
        with smp.tensor_parallelism():
            bad = MODELS[name].build(**changes)
        try:
            smp.DistributedModel(bad)
        except ModelParallelError as exc:
            out[key] = str(exc)
        smp.reset()
    with smp.tensor_parallelism():
        kernel = MODELS["bert"].build(attention_probs_dropout_prob=0.1)  # BERT's default
    kernel.set_attn_implementation("sdpa")
    try:
        smp.DistributedModel(kernel)
    except ModelParallelError as exc:
        out["dropout"] = str(exc)
    smp.reset()
    for name, changes in DROPPING.items():
        torch.manual_seed(SEED + smp.rank())  # the group draws from its first rank's generator
        out[f"dropping {name}"] = _train(name, **changes)
        smp.reset()
    out["hidden"] = _hidden_states()
    smp.shutdown()
    for layout, (config, name) in LAYOUTS.items():
        smp.init({"tensor_parallel_degree": 2, "ddp": True, **config})
        out[layout] = _train(name)
        if layout == "prescaled":
            smp.reset()
            torch.manual_seed(SEED + smp.rank())
            out["prescaled dropping"] = _train(name, **DROPPING[name])
        smp.shutdown()
    dist.destroy_process_group()
    return out


UNSPLIT = {"bad": ("llama", {"num_key_value_heads": 1}), "bad_t5": ("t5", {"num_heads": 3})}
"""Models whose heads do not split over 2 ranks: the error's key, the model, its config's
changes."""
SEED = 5
DROPPING = {
    "gptneox": {"attention_dropout": 0.1, "hidden_dropout": 0.1},
    "bert": {"attention_probs_dropout_prob": 0.1, "hidden_dropout_prob": 0.1},
    "gptj": {"attn_pdrop": 0.1},
    "t5": {"dropout_rate": 0.1},
    "vit": {"attention_probs_dropout_prob": 0.1, "hidden_dropout_prob": 0.1},
    "gptneo": {"attention_dropout": 0.1},
    "t5_gated": {"dropout_rate": 0.1},
    "llama": {"attention_dropout": 0.1},
    "roberta": {"attention_probs_dropout_prob": 0.1},
}
"""Models trained again with dropout on the attention probabilities (GPT-NeoX, BERT, T5 and
ViT: on their hidden states too; T5's on its feed-forward's split features too, gated or not);
GPT-J and GPT-Neo draw it in a dropout module of their attention, the others in HF's eager
attention function. Llama and RoBERTa drop the attention probabilities alone, so their losses
differ from those without dropout only if that dropout is drawn."""

HIDDEN = "llama"
"""Asked for every layer's hidden states (HF 5 collects them with hooks)."""
LAYOUTS = {
    "prescaled": ({"prescaled_batch": True}, "bert"),
    "microbatches": ({"microbatches": 2}, "llama"),
    "delayed": ({"delayed_parameter_initialization": True}, "gptneox"),
}
"""Models trained again in other layouts: with ``prescaled_batch`` both ranks bring the whole
batch; with two microbatches each rank runs its rows in two forwards (the plan's order); delayed,
the model is created without memory and each layer is made and split in place when wrapped."""


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(2, _on_ranks, timeout=240, env=hf_cases.HF_ENV)


SPLIT = {
    "gptneox": 16,
    "llama": 14,
    "llama_checkpointed": 14,
    "llama_smp_checkpointed": 14,
    "gptj": 16,
    "bert": 24,
    "roberta": 24,
    "gptneo": 18,
    "t5": 34,
    "t5_gated": 38,
    "vit": 24,
}
"""Parameters held as DTensors: each split layer's weight, and its bias where it has one. T5's
encoder block: q, k, v, o, wi, wo (gated: wi_0, wi_1); the decoder's also the cross attention's
q, k, v, o; each first block its relative position bias (split by heads)."""


def _trains_as_one_process(ranks: list[dict[str, Any]], key: str, name: str) -> None:
    """The ranks' mean losses and every rank's parameters under ``key`` are those of model
    ``name`` trained in one process."""
    losses, params = _plain(name)
    mean = [sum(rank[key]["losses"][step] for rank in ranks) / len(ranks) for step in range(STEPS)]
    assert mean == pytest.approx(losses, rel=1e-5)
    for rank in ranks:
        for param, value in params.items():
            torch.testing.assert_close(
                rank[key]["state"][param], value, rtol=1e-4, atol=1e-6, msg=param
            )


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_trains_on_two_tensor_parallel_ranks_as_one_process(
    ranks: list[dict[str, Any]], name: str
) -> None:
    _trains_as_one_process(ranks, name, name)
    for rank in ranks:
        assert rank[name]["split"] == SPLIT[name]
        state = rank[name]["state"]
        MODELS[name].build().load_state_dict(state)  # strict: HF's own keys
        initial = MODELS[name].build().state_dict()
        assert rank[name]["reloaded"].keys() == initial.keys()
        for key, value in initial.items():
            assert torch.equal(rank[name]["reloaded"][key], value), key


@pytest.mark.parametrize(
    ("key", "error"),
    [
        (
            "bad",
            "smp.DistributedModel: the model (LlamaForCausalLM) cannot be distributed: "
            "smp.nn.huggingface.llama: num_key_value_heads=1 does not split over "
            "tensor_parallel_degree=2; allowed: a multiple of 2",
        ),
        (
            "bad_t5",
            "smp.DistributedModel: the model (T5ForConditionalGeneration) cannot be distributed: "
            "smp.nn.huggingface.t5: num_heads=3 does not split over tensor_parallel_degree=2; "
            "allowed: a multiple of 2",
        ),
    ],
)
def test_heads_that_do_not_split_fail_naming_them(
    ranks: list[dict[str, Any]], key: str, error: str
) -> None:
    assert ranks[0][key] == error


def test_attention_dropout_in_a_kernel_fails_when_wrapped_naming_the_field(
    ranks: list[dict[str, Any]],
) -> None:
    assert ranks[0]["dropout"] == (
        "smp.DistributedModel: the model (BertForMaskedLM) cannot be distributed: "
        "smp.nn.huggingface.bert: config.attention_probs_dropout_prob=0.1 with "
        "attn_implementation='sdpa' is not supported at tensor_parallel_degree 2: sdpa draws "
        "the dropout mask of the rank's heads inside its kernel, unlike the one a single "
        "process draws for all heads; allowed: attn_implementation='eager' (an argument of "
        "from_pretrained / from_config, or model.set_attn_implementation('eager') before "
        "wrapping), or attention_probs_dropout_prob=0 in the config the model is created from"
    )


def _one_process(name: str, **changes: Any) -> dict[str, Any]:
    """Model ``name`` marked and trained in one process from the generator at :data:`SEED`."""
    with single_process({"ddp": True}):
        torch.manual_seed(SEED)
        return _train(name, **changes)


def _trains_as_the_marked_model(got: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    mean = [sum(rank["losses"][step] for rank in got) / len(got) for step in range(STEPS)]
    assert mean == pytest.approx(expected["losses"], rel=1e-5)
    for rank in got:
        for key, value in expected["state"].items():
            torch.testing.assert_close(rank["state"][key], value, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", list(DROPPING))
def test_attention_dropout_trains_on_two_tensor_parallel_ranks_as_one_process(
    ranks: list[dict[str, Any]], name: str
) -> None:
    """Each rank draws the mask of every head and keeps its own heads': the masks, and so the
    losses and parameters, of one process drawing from the group's first rank's generator (the
    losses without dropout differ)."""
    got = [rank[f"dropping {name}"] for rank in ranks]
    assert got[0]["losses"] != pytest.approx(ranks[0][name]["losses"], rel=1e-5)
    _trains_as_the_marked_model(got, _one_process(name, **DROPPING[name]))


def test_attention_dropout_with_a_prescaled_batch_trains_as_one_process(
    ranks: list[dict[str, Any]],
) -> None:
    name = LAYOUTS["prescaled"][1]
    expected = _one_process(name, **DROPPING[name])
    _trains_as_the_marked_model([rank["prescaled dropping"] for rank in ranks], expected)


DROPOUTS = [
    ("bert", "Bert", {}, "eager", 2, None),
    ("bert", "Bert", {}, "sdpa", 2, "attention_probs_dropout_prob=0.1 with attn_impl"),
    ("bert", "Bert", {}, "sdpa", 1, None),
    ("bert", "Bert", {"attention_probs_dropout_prob": 0.0}, "sdpa", 2, None),
    ("roberta", "Roberta", {}, "flex_attention", 4, "attention_probs_dropout_prob=0.1 with"),
    ("llama", "Llama", {}, "sdpa", 2, None),
    ("llama", "Llama", {"attention_dropout": 0.2}, "sdpa", 2, "attention_dropout=0.2 with"),
    ("gptj", "GPTJ", {"attn_pdrop": 0.1}, "flash_attention_2", 2, "attn_pdrop=0.1 with"),
    ("gptneo", "GPTNeo", {"attention_dropout": 0.1}, "eager", 2, None),
    ("gptneox", "GPTNeoX", {"attention_dropout": 0.1}, "sdpa", 2, "attention_dropout=0.1 with"),
    ("gptneox", "GPTNeoX", {"hidden_dropout": 0.1}, "sdpa", 2, None),
    ("t5", "T5", {}, "sdpa", 2, "dropout_rate=0.1 with"),  # T5's one dropout: attention's too
    ("t5", "T5", {}, "eager", 2, None),
    ("vit", "ViT", {}, "sdpa", 2, None),
    ("vit", "ViT", {"attention_probs_dropout_prob": 0.1}, "sdpa", 2, "attention_probs_dropout"),
]
"""Family, config class, fields other than the defaults, attention implementation, tp degree,
the refused field (None: accepted). BERT's, RoBERTa's and T5's default attention dropout is
0.1, the others' 0."""


@pytest.mark.parametrize(
    ("family", "kind", "fields", "implementation", "degree", "refused"), DROPOUTS
)
def test_attention_dropout_above_zero_needs_eager_attention_at_tp_above_one(
    family: str,
    kind: str,
    fields: dict[str, Any],
    implementation: str,
    degree: int,
    refused: str | None,
) -> None:
    import transformers

    config = getattr(transformers, f"{kind}Config")(**fields)
    config._attn_implementation = implementation
    of = getattr(smp.nn.huggingface, family).FAMILY
    if refused is None:
        attention_dropout(config, of, degree)
    else:
        with pytest.raises(ModelParallelError, match=rf"config\.{refused}"):
            attention_dropout(config, of, degree)


@pytest.mark.parametrize("inplace_", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dropout_draws_the_slice_of_one_processs_mask(
    dtype: torch.dtype, inplace_: bool
) -> None:
    """Rank r of 2 keeps heads 2r and 2r+1 of the mask one process draws for all 4, bit for
    bit; outside training or at p=0 the probabilities pass unchanged."""
    probs = torch.rand(3, 4, 5, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    torch.manual_seed(7)
    whole = F.dropout(probs, p=0.1)
    for rank in range(2):
        torch.manual_seed(7)
        mine = probs[:, 2 * rank : 2 * rank + 2].clone()
        with HeadDropout(rank, 2, "x"):
            got = F.dropout(mine, p=0.1, training=True, inplace=inplace_)
            assert torch.equal(F.dropout(mine, p=0.1, training=False), mine)
            assert torch.equal(nn.Dropout(0.0)(mine), mine)
        assert torch.equal(got, whole[:, 2 * rank : 2 * rank + 2])
        assert (got is mine) == inplace_


def test_feature_dropout_draws_the_slice_of_one_processs_mask() -> None:
    """T5's feed-forward dropout on split features (``dim=-1``): rank r of 2 keeps features
    4r to 4r+3 of the mask one process draws for all 8, whatever the tensor's rank."""
    features = torch.rand(3, 5, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(7)
    whole = F.dropout(features, p=0.5)
    for rank in range(2):
        torch.manual_seed(7)
        with HeadDropout(rank, 2, "x", dim=-1):
            got = nn.Dropout(0.5)(features[..., 4 * rank : 4 * rank + 4])
        assert torch.equal(got, whole[..., 4 * rank : 4 * rank + 4])


def test_head_dropout_refuses_what_is_not_attention_probabilities() -> None:
    with (
        HeadDropout(0, 2, "smp.nn.huggingface.x"),
        pytest.raises(
            ModelParallelError,
            match=r"smp.nn.huggingface.x: .* shape \[3, 4\], where \[rows, heads",
        ),
    ):
        nn.Dropout(0.1)(torch.ones(3, 4))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_other_layouts_train_as_one_process(ranks: list[dict[str, Any]], layout: str) -> None:
    _trains_as_one_process(ranks, layout, LAYOUTS[layout][1])


def _tied_head(to: str) -> tuple[nn.Module, nn.Module]:
    """A model whose head shares its weight with the base model's ``to`` (``[4, 3]`` both)."""
    root = nn.Module()
    root.base = nn.Module()
    root.base.embed = nn.Embedding(4, 3)
    root.base.layer = nn.Linear(3, 4)
    root.head = nn.Linear(3, 4, bias=False)
    root.head.weight = root.base.get_submodule(to).weight
    return root, root.base


@pytest.mark.parametrize(
    ("tied_to", "error"),
    [
        ("embed", None),  # BERT's decoder: the word embedding runs on the rank's rows
        ("layer", "smp.nn.huggingface.x: parameter 'head.weight' is 'layer.weight' of the base"),
    ],
)
def test_a_region_parameter_used_outside_it_is_refused(tied_to: str, error: str | None) -> None:
    root, base = _tied_head(tied_to)
    if error is None:
        inplace._refuse_ties(root, base, base.embed, "smp.nn.huggingface.x")
        return
    with pytest.raises(ModelParallelError, match=error):
        inplace._refuse_ties(root, base, base.embed, "smp.nn.huggingface.x")


def test_hidden_states_come_back_as_the_ranks_rows(ranks: list[dict[str, Any]]) -> None:
    model = MODELS[HIDDEN].build()
    with torch.no_grad():
        batch = hf_cases.CASES[MODELS[HIDDEN].batches].batch(0)
        whole = model(**batch, output_hidden_states=True).hidden_states
    for rank in ranks:
        rows, states = rank["hidden"]
        assert len(states) == len(whole) == 3
        for state, expected in zip(states, whole, strict=True):
            torch.testing.assert_close(state, expected[rows], rtol=1e-5, atol=1e-6)


IDS = torch.zeros(2, 4, dtype=torch.long)


@pytest.mark.parametrize(
    ("family", "inputs", "error"),
    [
        ("llama", {"input_ids": IDS, "use_cache": None, "position_ids": IDS}, None),
        ("llama", {"inputs_embeds": torch.zeros(2, 4, 8), "use_cache": False}, None),
        ("llama", {"input_ids": IDS, "use_cache": True}, "use_cache and past_key_values"),
        ("llama", {"input_ids": IDS, "past_key_values": ()}, "use_cache and past_key_values"),
        ("llama", {"input_ids": IDS, "output_attentions": True}, "output_attentions is not"),
        ("bert", {"input_ids": IDS, "cache_position": IDS[0]}, r"inputs \['cache_position'\]"),
        ("bert", {"attention_mask": IDS}, "input_ids or inputs_embeds are required"),
        ("bert", {"input_ids": IDS, "token_type_ids": IDS}, None),
        ("gptj", {"input_ids": IDS, "token_type_ids": IDS}, "token_type_ids is not supported"),
        ("t5", {"input_ids": IDS, "encoder_hidden_states": torch.zeros(2, 4, 8)}, None),
        ("t5", {"inputs_embeds": torch.zeros(2, 4, 8), "encoder_attention_mask": IDS}, None),
        ("t5", {"attention_mask": IDS}, "input_ids or inputs_embeds are required"),
        ("vit", {"pixel_values": torch.zeros(2, 3, 8, 8), "bool_masked_pos": IDS}, None),
        ("vit", {"attention_mask": IDS}, "pixel_values are required"),
        ("vit", {"pixel_values": IDS, "input_ids": IDS}, r"inputs \['input_ids'\]"),
    ],
)
def test_inputs_a_split_model_cannot_honour_are_refused(
    family: str, inputs: dict[str, Any], error: str | None
) -> None:
    spec = getattr(smp.nn.huggingface, family).FAMILY
    config = SimpleNamespace(output_attentions=False)
    if error is None:
        inplace._refuse_inputs(inputs, config, spec)
        return
    with pytest.raises(ModelParallelError, match=error):
        inplace._refuse_inputs(inputs, config, spec)


@pytest.mark.parametrize(
    ("family", "hooks", "model"),
    [("t5", "get_hf_t5_transformer_layer_hooks", "T5"), ("vit", "get_hf_vit_encoder_hooks", "ViT")],
)
def test_smps_hooks_are_refused_naming_the_way_that_works(
    family: str, hooks: str, model: str
) -> None:
    with pytest.raises(ModelParallelError, match=f"create the whole {model} model inside"):
        getattr(getattr(smp.nn.huggingface, family), hooks)()


def test_attention_maps_asked_by_the_config_are_refused() -> None:
    config = SimpleNamespace(output_attentions=True)
    with pytest.raises(ModelParallelError, match="output_attentions is not supported"):
        inplace._refuse_inputs({"input_ids": IDS}, config, smp.nn.huggingface.llama.FAMILY)


ROWS = {
    "llama": ["lm_head.weight", "model.embed_tokens.weight"],
    "bert": [
        "bert.embeddings.word_embeddings.weight",
        "cls.predictions.bias",
        "cls.predictions.transform.LayerNorm.bias",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.dense.weight",
    ],
    "t5": ["shared.weight"],  # the encoder's and decoder's embeddings and the LM head
    "vit": ["classifier.bias", "classifier.weight"],
}
"""Parameters that see the rank's own rows: the word embedding and what is outside the base
model (every other one sees the tp group's batch)."""


@pytest.mark.parametrize("name", list(ROWS))
def test_a_marked_model_at_degree_one_trains_as_the_plain_model(name: str) -> None:
    """Marked modules are swapped at tensor_parallel_degree 1 too (as SMP does): a family's
    model keeps its layers whole, and its base model's region gathers nothing."""
    with single_process({"ddp": True}):
        result = _train(name)
    losses, params = _plain(name)
    assert result["split"] == 0
    assert result["rows"] == ROWS[name]
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    for key, value in params.items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-4, atol=1e-6, msg=key)


def test_a_delayed_model_split_in_place_is_made_one_layer_at_a_time(
    ranks: list[dict[str, Any]],
) -> None:
    """Wrapping makes and splits the transformer layers alone (one at a time): the rest stays
    without memory until the first step, so no rank holds the whole model."""
    for rank in ranks:
        assert rank["delayed"]["unmade"] == [
            "gpt_neox.embed_in.weight",
            "gpt_neox.final_layer_norm.bias",
            "gpt_neox.final_layer_norm.weight",
            "lm_head.weight",
        ]
        assert rank["gptneox"]["unmade"] == []

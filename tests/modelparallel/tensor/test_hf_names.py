"""The names a family of Hugging Face models split in place looks for (``inplace.py``): checked
before anything is split, without processes, since a transformers version that renames a module
would otherwise leave layers unsplit or heads dropped unlike one process, silently; and SMP's
half-precision switches, which such a model cannot honour, said so."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import swap
from dtrain.modelparallel.tensor.huggingface import inplace
from dtrain.modelparallel.tensor.huggingface.family import HeadDropout, check_names, per_head
from tests.modelparallel.harness import single_process
from tests.modelparallel.tensor.test_hf import MODELS

pytest.importorskip("transformers")


def _bases(model: nn.Module, family: inplace.Family) -> list[nn.Module]:
    root = model.base_model
    return [getattr(root, name) for name in family.bases if hasattr(root, name)] or [root]


def _check(model: nn.Module) -> None:
    """What ``parallelize`` checks, at tp > 1 with every dropout above 0."""
    family = getattr(smp.nn.huggingface, inplace.family_of(type(model)) or "").FAMILY
    for base in _bases(model, family):
        check_names(base, family, True, family.split_dropout)


@pytest.mark.parametrize(
    "name", ["gptneox", "llama", "gptj", "bert", "roberta", "gptneo", "t5", "t5_gated", "vit"]
)
def test_every_family_finds_its_layers_linears_and_dropouts(name: str) -> None:
    _check(MODELS[name].build())


def _rename(root: nn.Module, path: str, new: str) -> None:
    parent, _, old = path.rpartition(".")
    holder = root.get_submodule(parent)
    setattr(holder, new, getattr(holder, old))
    delattr(holder, old)


@pytest.mark.parametrize(
    "name, renamed, error",
    [
        ("llama", ["model.layers"], r"no module of LlamaModel matches 'layers\.\*'"),
        (  # the layer's row-wise linears
            "llama",
            ["model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj"],
            r"no module of LlamaDecoderLayer matches any of \('self_attn.o_proj', 'mlp.down_",
        ),
        (  # its projections split, its attention probabilities' dropout not found
            "gptneo",
            ["transformer.h.0.attn.attention.attn_dropout"],
            r"1 modules of GPTNeoModel match 'h\.\*\.attn\.attention\.attn_dropout', where its "
            r"dropout is drawn per head, for 2 layers",
        ),
        (  # T5's feed-forward dropout on split features
            "t5",
            ["decoder.block.1.layer.2.DenseReluDense"],
            r"1 modules of T5Stack match 'block\.\*\.layer\.\*\.DenseReluDense', where",
        ),
    ],
)
def test_names_a_transformers_version_changed_are_refused_naming_family_and_version(
    name: str, renamed: list[str], error: str
) -> None:
    model = MODELS[name].build()
    for path in renamed:
        _rename(model, path, "renamed")
    message = rf"smp.nn.huggingface.{name}: {error}.*this transformers version \(\d"
    with pytest.raises(ModelParallelError, match=message):
        _check(model)


def test_head_dropout_refuses_attention_that_drops_inside_its_kernel() -> None:
    q = torch.ones(1, 2, 3, 4)
    with HeadDropout(0, 2, "smp.nn.huggingface.x"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
        with pytest.raises(ModelParallelError, match=r"x: scaled_dot_product_attention with dr"):
            F.scaled_dot_product_attention(q, q, q, None, 0.1)


@pytest.mark.parametrize("training", [True, False])
def test_attention_switched_after_wrapping_fails_where_it_drew_no_dropout(training: bool) -> None:
    # HF's set_attn_implementation after the split: SDPA drops inside its kernel (here with
    # dropout_p=0.1 in training), so the rank's heads would be dropped unlike one process.
    model = MODELS["llama"].build(attention_dropout=0.1).train(training)
    for layer in model.model.layers:
        per_head(layer.self_attn, 0, 2, "smp.nn.huggingface.llama")
    ids = torch.arange(8).reshape(2, 4)
    model(input_ids=ids)  # eager: drawn per head (in training)
    model.set_attn_implementation("sdpa")
    if training:
        with pytest.raises(ModelParallelError, match=r"llama: scaled_dot_product_attention"):
            model(input_ids=ids)
    else:
        model(input_ids=ids)


def test_a_module_whose_training_forward_draws_no_dropout_fails_naming_it() -> None:
    class Attention(nn.Module):  # another implementation, or a version's other code
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(x, x, x)

    module = Attention()
    per_head(module, 1, 2, "smp.nn.huggingface.x")
    x = torch.ones(1, 2, 3, 4)
    with pytest.raises(ModelParallelError, match=r"x: Attention's forward drew no dropout"):
        module(x)
    module.eval()(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_half_precision_switches_without_effect_in_place_are_said(dtype: torch.dtype) -> None:
    """SMP's ``attention_in_fp32`` acts in its distributed transformer; a model split in place
    runs HF's attention, so in half precision the switch is said to do nothing (in fp32 it
    never does anything: nothing is said)."""
    with single_process({}):
        model = MODELS["bert"].build().to(dtype)
        smp.set_tensor_parallelism(model, attention_in_fp32=True, query_key_layer_scaling=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            swap.distribute(model)
    said = [str(w.message) for w in caught if "has no effect on a model split in" in str(w.message)]
    expected = "smp.nn.huggingface.bert: attention_in_fp32=True has no effect on a model split in"
    assert [text[: len(expected)] for text in said] == (
        [expected] if dtype != torch.float32 else []
    )

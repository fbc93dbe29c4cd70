"""Marking modules for tensor parallelism and swapping them (one process, tp 1: the swap is the
same at any degree; two ranks train swapped models in test_tensor_equivalence)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import dtrain.modelparallel as smp
from dtrain.compat import SHIM_ROOT
from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import activations
from dtrain.modelparallel.tensor import swap
from tests.modelparallel.harness import single_process


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.table(ids))))


class Scale(nn.Module):
    """A user's module with a registered distributed counterpart of another signature."""

    def __init__(self, n: int, factor: float = 2.0) -> None:
        super().__init__()
        self.factor = factor
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight * self.factor


class DistScale(nn.Module):
    def __init__(self, size: int, factor: float, extra: float = 0.0) -> None:
        super().__init__()
        self.factor, self.extra = factor, extra
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, inputs: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        return (inputs[0] * self.weight * self.factor + self.extra,)


def _scale_args(n: int, factor: float = 2.0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (), {"size": n, "factor": factor}


@pytest.fixture(autouse=True)
def _one_process() -> Any:
    with single_process({}):
        yield


def test_modules_created_inside_are_swapped_with_their_weights() -> None:
    with smp.tensor_parallelism():
        block = Block()
        with smp.tensor_parallelism(enabled=False):
            kept = nn.Linear(4, 4)
    outside = nn.Linear(4, 4)
    block.add_module("kept", kept)
    block.add_module("outside", outside)
    block.add_module("again", block.up)  # shared: swapped once
    plain = copy.deepcopy(block)
    assert swap.distribute(block) is block
    assert type(block.table) is smp.nn.DistributedEmbedding
    assert type(block.up) is type(block.down) is smp.nn.DistributedLinear
    assert block.again is block.up and block.down.bias is None
    assert block.kept is kept and block.outside is outside
    assert block.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert torch.equal(block.state_dict()[key], value), key
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(block(ids), plain(ids))


class TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.table.weight


def test_a_weight_tied_across_a_swap_fails_naming_both_instead_of_untying() -> None:
    with smp.tensor_parallelism():
        model = TiedHead()
    with pytest.raises(ModelParallelError, match=r"'table.weight' \(distributed as 'table'\) "
                       r"and 'head.weight' \(distributed as 'head'\) are one tensor"):  # fmt: skip
        swap.distribute(model)
    assert type(model.table) is nn.Embedding  # nothing swapped
    plain = TiedHead()
    smp.set_tensor_parallelism(plain.head)
    with pytest.raises(ModelParallelError, match=r"\(kept as it is\) and 'head.weight'"):
        swap.distribute(plain)


def test_set_tensor_parallelism_marks_an_existing_module_and_its_children() -> None:
    block = Block()
    smp.set_tensor_parallelism(block)
    smp.set_tensor_parallelism(block.down, enabled=False)
    swap.distribute(block)
    assert type(block.up) is smp.nn.DistributedLinear and type(block.down) is nn.Linear
    root = nn.Linear(2, 2)
    smp.set_tensor_parallelism(root)
    assert type(swap.distribute(root)) is smp.nn.DistributedLinear
    state.register_model(object())
    with pytest.raises(ModelParallelError, match=r"after smp\.DistributedModel has no effect"):
        smp.set_tensor_parallelism(Block())


def test_registered_modules_take_hooks_and_the_context_arguments_they_accept() -> None:
    early = Scale(3)
    smp.tp_register_with_module(
        Scale,
        DistScale,
        init_hook=_scale_args,
        forward_hook=lambda x: (((x,),), {}),
        return_hook=lambda out: out[0],
    )
    with smp.tensor_parallelism(extra=1.0, fused_softmax=False):  # DistScale takes extra only
        scale = Scale(3, factor=3.0)
    swapped = swap.distribute(scale)
    assert type(swapped) is DistScale and (swapped.factor, swapped.extra) == (3.0, 1.0)
    torch.testing.assert_close(swapped(torch.ones(3)), torch.full((3,), 4.0))
    smp.set_tensor_parallelism(early)
    with pytest.raises(TypeError, match="Scale was created before its registration"):
        swap.distribute(early)
    with pytest.raises(TypeError, match=r"dist_module must be an nn\.Module class"):
        smp.tp_register(print)  # type: ignore[arg-type]


def test_tp_register_decorates_a_class() -> None:
    @smp.tp_register(DistScale, init_hook=_scale_args)
    class Decorated(Scale):
        pass

    with smp.model_creation(tensor_parallelism=True):
        made = Decorated(2)
    assert type(swap.distribute(made)) is DistScale


class Gated(Scale):
    """A registered module with a submodule, which its distributed module does not have."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.gate = nn.Linear(n, n)


@pytest.mark.filterwarnings("ignore:.*DistScale replacing Gated has other parameter names")
def test_a_checkpointing_mark_moves_to_the_distributed_module() -> None:
    block = Block()
    smp.set_tensor_parallelism(block)
    smp.set_activation_checkpointing(block.up)
    swap.distribute(block)
    assert type(block.up) is smp.nn.DistributedLinear
    assert activations.kept_whole(block) == {"up"}
    smp.tp_register_with_module(Gated, DistScale, init_hook=_scale_args)
    with smp.tensor_parallelism():
        holder = nn.Sequential(Gated(3))
    smp.set_activation_checkpointing(holder[0].gate)
    marked = r"module '0' \(Gated\) cannot be distributed: .* marked its submodule 'gate'"
    with pytest.raises(ModelParallelError, match=marked):
        swap.distribute(holder)


def test_awss_scripts_imports_and_creation_switches_are_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AWS's ``train_gpt_simple.py`` imports the GPT-2 translation under its suffixed name and
    passes SMP's kernel switches (``fused_dropout`` among them) to ``smp.model_creation``; its
    GPT-NeoX script passes more, and transformer options at their defaults for any model."""
    monkeypatch.syspath_prepend(str(SHIM_ROOT))
    from smdistributed.modelparallel.torch.nn.huggingface import gpt2

    from dtrain.modelparallel.tensor.huggingface.inplace import IN_PLACE_DEFAULTS
    from dtrain.modelparallel.tensor.module import TUNING_ARGUMENTS, refuse_unsupported

    assert (
        gpt2.translate_hf_state_dict_to_smdistributed_gpt2
        is gpt2.translate_hf_state_dict_to_smdistributed
    )
    switches = ("fused_softmax", "fused_dropout", "fused_bias_gelu", "attention_in_fp32")
    switches += ("flash_attention", "zero_init")  # and AWS's GPT-NeoX script
    assert set(switches) <= TUNING_ARGUMENTS
    refuse_unsupported("smp.nn.X", dict.fromkeys(switches, True), {})
    defaults = {"use_alibi": False, "fp32_residual_addition": False, "distribute_embedding": False}
    refuse_unsupported("smp.nn.huggingface.gptneox", defaults, IN_PLACE_DEFAULTS)
    with pytest.raises(ModelParallelError, match="distribute_embedding=True is not supported"):
        refuse_unsupported("x", {"distribute_embedding": True}, IN_PLACE_DEFAULTS)


SHIM_NAMES = {
    "gpt2": [
        "translate_hf_state_dict_to_smdistributed_gpt2_layer",
        "translate_state_dict_to_hf_gpt2_layer",
        "get_hf_gpt2_transformer_lm_head_hooks",
        "get_hf_gpt2_transformer_layer_hooks",
    ],
    "gptj": [
        "translate_hf_state_dict_to_smdistributed_gptj",
        "translate_state_dict_to_hf_gptj",
        "translate_hf_gptj_state_dict_to_smdistributed",
        "get_hf_gptj_transformer_hooks",
    ],
    "gptneo": [
        "translate_hf_state_dict_to_smdistributed_gptneo",
        "get_hf_gptneo_transformer_lm_head_hooks",
    ],
    "gptneox": ["translate_state_dict_to_hf_gptneox", "get_hf_gptneox_transformer_lm_head_hooks"],
    "bert": ["translate_hf_state_dict_to_smdistributed_bert", "get_hf_bert_transformer_hooks"],
    "roberta": [
        "translate_hf_state_dict_to_smdistributed_roberta",
        "get_hf_roberta_transformer_hooks",
    ],
}
"""Names of SMP 1.12's ``smdistributed.modelparallel.torch.nn.huggingface`` modules that AWS's
scripts import (the GPT-J tensor-parallel script: ``gptj``'s translations)."""


def test_smps_huggingface_modules_import_with_their_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks come from the registration that swaps the model; those of a swap dtrain does not
    make fail, naming the way that works."""
    import importlib

    from dtrain.modelparallel.tensor.huggingface import gpt2, gptj, gptneox

    monkeypatch.syspath_prepend(str(SHIM_ROOT))
    shim = "smdistributed.modelparallel.torch.nn.huggingface"
    for family, names in SHIM_NAMES.items():
        module = importlib.import_module(f"{shim}.{family}")
        assert all(callable(getattr(module, name)) for name in names), family
    for translation, getter in (
        (gpt2, gpt2.get_hf_gpt2_transformer_lm_head_hooks),
        (gptj, gptj.get_hf_gptj_transformer_hooks),
        (gptneox, gptneox.get_hf_gptneox_transformer_lm_head_hooks),
    ):
        registration = translation.REGISTRATION
        hooks = (registration.init_hook, registration.forward_hook, registration.return_hook)
        assert getter() == hooks
    refused = {
        "bert": ("get_hf_bert_transformer_hooks", "create the whole BERT model inside"),
        "roberta": ("get_hf_roberta_transformer_hooks", "create the whole RoBERTa model inside"),
        "gptneo": ("get_hf_gptneo_transformer_lm_head_hooks", "the whole GPT-Neo model inside"),
        "gpt2": (
            "get_hf_gpt2_transformer_layer_hooks",
            "becomes an smp.nn.DistributedTransformerLMHead",
        ),
    }
    for family, (getter, works) in refused.items():
        with pytest.raises(
            ModelParallelError, match=f"{getter}: .* not supported by dtrain; .*{works}"
        ):
            getattr(importlib.import_module(f"{shim}.{family}"), getter)()
    assert smp.nn.DistributedLayerNorm(8).normalized_shape == (8,)  # tp 1: a layer norm


def test_a_gpt2_block_translates_to_a_distributed_layer_and_back() -> None:
    transformers = pytest.importorskip("transformers")
    from dtrain.modelparallel.tensor.huggingface import gpt2

    config = transformers.GPT2Config(n_embd=8, n_head=2, n_inner=16, n_positions=8)
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block(config)
    layer = smp.nn.DistributedTransformerLayer(
        num_attention_heads=2, attention_head_size=4, hidden_size=8, intermediate_size=16,
        pre_layernorm=True, post_layernorm=False,
    )  # fmt: skip
    ours = gpt2.translate_hf_state_dict_to_smdistributed_gpt2_layer(block.state_dict())
    layer.load_state_dict(ours)  # strict: every key of the layer
    back = gpt2.translate_state_dict_to_hf_gpt2_layer(layer.state_dict())
    assert back.keys() == block.state_dict().keys()
    for key, value in block.state_dict().items():
        assert torch.equal(back[key], value), key


def test_a_built_in_swap_that_cannot_honour_an_argument_keeps_the_module_with_a_warning() -> None:
    """As SMP leaves a module it cannot distribute; an ``smp.nn`` module asked for it fails."""
    with smp.tensor_parallelism():
        model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 4))
    kept = model[0]
    kept_as_it_is = r"module '0' \(Embedding\) is kept as it is, not distributed: "
    with pytest.warns(UserWarning, match=kept_as_it_is + r".* does not implement max_norm=1\.0"):
        swap.distribute(model)
    assert model[0] is kept and type(model[1]) is smp.nn.DistributedLinear
    with pytest.raises(ModelParallelError, match=r"max_norm=1\.0 is not supported by dtrain"):
        smp.nn.DistributedEmbedding(10, 4, max_norm=1.0)
    assert smp.nn.DistributedEmbedding(10, 4, vocab_parallel=False).embedding_dim == 4
    with pytest.raises(ModelParallelError, match="vocab_parallel=True is not supported"):
        smp.nn.DistributedEmbedding(10, 4, vocab_parallel=True)

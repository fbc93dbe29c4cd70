"""Hugging Face models split in place: their own attention and feed-forward layers, cut by torch's
``ColwiseParallel`` / ``RowwiseParallel`` inside SMP's scaled batch (:mod:`..batch`).

A model of a supported family (:data:`FAMILIES`) marked for tensor parallelism keeps its modules,
names and forward. When ``smp.DistributedModel`` wraps it, its base model (HF's
``model.base_model``: ``LlamaModel``, ``BertModel``, ...; T5's encoder and decoder, each) is
changed in place:

* the linear layers of the family's plan are split: query / key / value and the feed-forward's
  first layers by output features (heads), the attention's output and the feed-forward's last
  layer by input features (one all-reduce each); attention modules that keep a head count for
  their reshapes get the rank's count (the others reshape with ``-1``);
* its forward becomes the tp group's scaled-batch region: the word embedding runs on the rank's
  own rows first (so a head tied to it, BERT's and RoBERTa's, sees one batch), then the
  embeddings and the batch inputs are gathered over the group, the base model runs on the
  combined batch, and its outputs are cut back to the rank's rows. Heads, poolers' users and
  losses outside the base model run on the rank's rows, as in the plain model.

Every parameter of the region (all of the base model's but the word embedding's) sees the
group's combined batch and averages as :mod:`..shards` says. ``state_dict()`` holds whole
tensors under HF's own names, so it loads into the plain model and back unchanged: SMP's
translation functions of these families (kept for scripts that call them) return their input
(GPT-NeoX's and GPT-J's translate, for their translation to SMP's LM head).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import shards
from dtrain.modelparallel.tensor.averages import mark_scaled_batch
from dtrain.modelparallel.tensor.batch import ScaledBatch, scaled_batch
from dtrain.modelparallel.tensor.huggingface.family import (
    Family,
    attention_dropout,
    check_names,
    layer_plan,
    matches,
    per_head,
)
from dtrain.modelparallel.tensor.module import (
    UNSUPPORTED_EXTRAS,
    refuse_unsupported,
    split,
    whole_state_dicts,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # imported only with a model of its own

FAMILIES = {
    "transformers.models.gpt_neox.modeling_gpt_neox": "gptneox",
    "transformers.models.llama.modeling_llama": "llama",
    "transformers.models.gptj.modeling_gptj": "gptj",
    "transformers.models.bert.modeling_bert": "bert",
    "transformers.models.roberta.modeling_roberta": "roberta",
    "transformers.models.gpt_neo.modeling_gpt_neo": "gptneo",
    "transformers.models.t5.modeling_t5": "t5",
    "transformers.models.vit.modeling_vit": "vit",
}
"""HF modelling modules → their family's file in :mod:`..huggingface`; every ``PreTrainedModel``
of such a module (``LlamaForCausalLM``, ``BertForMaskedLM``, ``RobertaModel``, ...) is split."""


def same_names(state_dict: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """SMP's translation between HF's and SMP's names: dtrain keeps HF's, so none is needed
    (``max_seq_len``, SMP's argument, is not needed either)."""
    del max_seq_len
    return dict(state_dict)


def hooks_refused(what: str, swapped: str, works: str) -> Callable[[], NoReturn]:
    """SMP's getter ``what`` of hooks that swap ``swapped`` for an ``smp.nn`` module, which
    dtrain does not do: calling it fails, naming ``works``, the way that does."""

    def refused() -> NoReturn:
        raise ModelParallelError(f"{what}: {swapped} is not supported by dtrain; {works}")

    refused.__name__ = refused.__qualname__ = what.rpartition(".")[2]
    return refused


def in_place(model: str) -> str:
    """How a model split in place is made tensor-parallel (the way :func:`hooks_refused`
    names)."""
    return (
        f"create the whole {model} model inside smp.tensor_parallelism() or mark it with "
        "smp.set_tensor_parallelism, and it is split in place"
    )


def family_of(kind: type[nn.Module]) -> str | None:
    """The family file of an HF model class, None for any other class."""
    name = FAMILIES.get(kind.__module__)
    return name if name is not None and hasattr(kind, "base_model_prefix") else None


IN_PLACE_DEFAULTS = {**UNSUPPORTED_EXTRAS, "distribute_embedding": False}
"""SMP's transformer options that AWS's scripts pass to ``smp.model_creation`` for any model
(the layers' and the LM head's ``distribute_embedding``): a model split in place keeps its own
layers, so only their defaults describe it."""


HALF_PRECISION_SWITCHES = ("attention_in_fp32", "query_key_layer_scaling")
"""SMP's switches for its attention's stability in fp16 and bf16 (``smp.nn`` attention)."""


def _warn_switches_without_effect(
    what: str, options: Mapping[str, Any], model: nn.Module, st: state.MPState
) -> None:
    """SMP's half-precision switches act in its distributed transformer, which SMP swapped
    these families' layers for; split in place, HF's attention runs as written and they change
    nothing. In half precision that is said, once per family and switch (Python's default
    warning filter shows a message once per place)."""
    half = st.config["fp16"] or st.config["bf16"]
    half = half or any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    for name in HALF_PRECISION_SWITCHES:
        if half and options.get(name):
            warnings.warn(
                f"{what}: {name}=True has no effect on a model split in place (its attention "
                "runs as Hugging Face wrote it); it takes effect in smp.nn attention "
                "(DistributedTransformerLMHead, DistributedTransformerLayer, ...)",
                stacklevel=2,
            )


def parallelize(model: nn.Module, family: Family, options: Mapping[str, Any]) -> nn.Module:
    """Split ``model`` (an HF model of ``family``) in place; ``options`` are its mark's. Each
    transformer layer is split on its own, so a model created without memory has one layer
    made at a time (:func:`..shards.split_delayed`), the rest at the first step."""
    what = family.what
    refuse_unsupported(what, options, IN_PLACE_DEFAULTS)
    config = model.config
    if family.check is not None:
        family.check(config)
    st = state.current(what)
    _warn_switches_without_effect(what, options, model, st)
    degree = st.tp_size
    dropping = degree > 1 and attention_dropout(config, family, degree) > 0
    split_dropout = family.split_dropout
    if split_dropout is not None and not (degree > 1 and getattr(config, split_dropout[1])):
        split_dropout = None
    for name in family.sizes:
        size = getattr(config, name, None)
        if size is not None:
            split(what, name, size)
    root = model.base_model
    bases = [getattr(root, name) for name in family.bases if hasattr(root, name)]
    for base in bases or [root]:
        check_names(base, family, dropping, split_dropout)
    for base in bases or [root]:
        _split_base(model, base, family, st.tp_rank, degree, dropping, split_dropout)
    return model


def _split_base(
    model: nn.Module,
    base: PreTrainedModel,
    family: Family,
    rank: int,
    degree: int,
    dropping: bool,
    split_dropout: tuple[str, str] | None,
) -> None:
    """Split ``base``'s layers in place (``dropping``: its attention dropout drawn per head;
    ``split_dropout``: the family's, drawn whole) and make its forward a scaled-batch region."""
    embedding = base.get_input_embeddings() if family.word_embedding else None
    _refuse_ties(model, base, embedding, family.what)
    for name, attribute in family.head_counts.items():
        for path, module in base.named_modules():
            if matches(path, f"{family.layers}.{name}"):
                setattr(module, attribute, getattr(module, attribute) // degree)
    for path, layer in base.named_modules():  # one by one: made one at a time if delayed
        if matches(path, family.layers):
            shards.parallelize(layer, layer_plan(family, layer), family.what)
        elif dropping and matches(path, f"{family.layers}.{family.dropout_in}"):
            per_head(layer, rank, degree, family.what)
        elif split_dropout and matches(path, f"{family.layers}.{split_dropout[0]}"):
            per_head(layer, rank, degree, family.what, dim=-1)
    shards.mark_block(base)
    if embedding is not None:
        mark_scaled_batch(embedding, False)  # the rank's own rows, before the region
    whole_state_dicts(base)
    base.forward = _region(base, embedding, family)


def _refuse_ties(model: nn.Module, base: nn.Module, embedding: nn.Module | None, what: str) -> None:
    """A parameter of the region that the model also uses outside it would add gradients of
    the group's batch to those of the rank's: refused, naming both."""
    kept = set() if embedding is None else {id(p) for p in embedding.parameters()}
    region = {
        id(p): name
        for name, p in base.named_parameters(remove_duplicate=False)
        if id(p) not in kept
    }
    where = next(path for path, module in model.named_modules() if module is base)
    for name, param in model.named_parameters(remove_duplicate=False):
        under_base = not where or name.startswith(f"{where}.")
        if id(param) in region and not under_base:
            raise ModelParallelError(
                f"{what}: parameter {name!r} is {region[id(param)]!r} of the base model, which "
                "runs on the tp group's combined batch while the rest runs on the rank's own "
                "rows; untie them, or leave the model undistributed"
            )


def _region(base: nn.Module, embedding: nn.Module | None, family: Family) -> Callable[..., Any]:
    """``base``'s forward as the tp group's scaled-batch region."""
    original = base.forward
    names = list(inspect.signature(original).parameters)
    what = family.what

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        inputs = {**dict(zip(names, args, strict=False)), **kwargs}
        _refuse_inputs(inputs, base.config, family)
        ids = inputs.pop("input_ids", None)
        if embedding is not None and ids is not None and inputs.get("inputs_embeds") is None:
            if family.positions is not None and inputs.get("position_ids") is None:
                inputs["position_ids"] = family.positions(base, ids)
            inputs["inputs_embeds"] = embedding(ids)
        elif ids is not None:
            inputs["input_ids"] = ids  # both given: the base model says so
        leading = family.inputs[0]
        rows = inputs[leading].shape[0]
        gathered = [
            value if isinstance(value, torch.Tensor) and value.shape[0] == rows else None
            for value in map(inputs.get, family.inputs)
        ]
        with scaled_batch(what, inputs[leading], *gathered[1:]) as batch:
            for name, value in zip(family.inputs, gathered, strict=True):
                if value is not None:
                    inputs[name] = batch.gather(value)
            combined = inputs[leading].shape[0]
            if "use_cache" in names:
                inputs["use_cache"] = False
            return _own_rows(original(**inputs), batch, combined)

    return forward


def _refuse_inputs(inputs: dict[str, Any], config: Any, family: Family) -> None:
    """Inputs the region cannot honour, named before anything runs."""
    what = family.what
    for name, why in family.refused_inputs.items():
        if inputs.get(name) is not None:
            raise ModelParallelError(f"{what}: {name} is not supported: {why}")
    if inputs.get("use_cache") or inputs.get("past_key_values") is not None:
        raise ModelParallelError(
            f"{what}: use_cache and past_key_values are not supported with tensor parallelism "
            "(a cache would hold the tp group's combined batch and the rank's heads)"
        )
    if inputs.get("output_attentions") or getattr(config, "output_attentions", False):
        raise ModelParallelError(
            f"{what}: output_attentions is not supported with tensor parallelism (each rank "
            "holds its own heads' attention maps)"
        )
    ids = ("input_ids",) if family.word_embedding else ()
    required = (*ids, family.inputs[0])
    if all(inputs.get(name) is None for name in required):
        raise ModelParallelError(f"{what}: {' or '.join(required)} are required")
    allowed = (*ids, *family.inputs)
    unknown = sorted(
        name
        for name, value in inputs.items()
        if isinstance(value, torch.Tensor) and name not in allowed
    )
    if unknown:
        raise ModelParallelError(
            f"{what}: inputs {unknown} are not supported with tensor parallelism; allowed "
            f"tensors: {', '.join(allowed)}"
        )


def _own_rows(value: Any, batch: ScaledBatch, combined: int) -> Any:
    """The base model's outputs with every tensor of the combined batch cut to the rank's rows."""
    if isinstance(value, torch.Tensor):
        return batch.scatter(value) if value.dim() and value.shape[0] == combined else value
    if isinstance(value, dict):  # HF's ModelOutput too, whose items are its non-None fields
        for key, item in list(value.items()):
            value[key] = _own_rows(item, batch, combined)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_own_rows(item, batch, combined) for item in value)
    return value

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
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.overrides import TorchFunctionMode

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import shards
from dtrain.modelparallel.tensor.averages import mark_scaled_batch
from dtrain.modelparallel.tensor.batch import ScaledBatch, scaled_batch
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

BATCH_INPUTS = ("inputs_embeds", "attention_mask", "token_type_ids", "position_ids")
"""Base-model inputs holding the batch's rows, gathered over the tp group (``position_ids`` of
one row, shared by the batch, stays as it is); the first leads (:attr:`Family.inputs`)."""


@dataclass(frozen=True)
class Family:
    """What differs between the families: layer names, size fields, head-count attributes."""

    name: str
    """SMP's name, ``smp.nn.huggingface.<name>``."""
    layers: str
    """The base model's transformer layers, a pattern (``layers.*``)."""
    colwise: tuple[str, ...]
    """Linear layers of a layer split by output features (query, key, value, the first of the
    feed-forward)."""
    rowwise: tuple[str, ...]
    """Linear layers of a layer split by input features (the attention's output, the last of
    the feed-forward)."""
    sizes: tuple[str, ...]
    """Config fields that must split over the tp degree (heads, kv heads, intermediate size)."""
    head_counts: dict[str, str] = field(default_factory=dict)
    """Modules of a layer whose attribute holds the head count their reshapes use → its name."""
    refused_inputs: dict[str, str] = field(default_factory=dict)
    """Base-model inputs this family cannot take, with why."""
    positions: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    """Position ids the base model would derive from ``input_ids`` (it derives others from
    embeddings): computed before the embedding replaces them."""
    check: Callable[[Any], None] | None = None
    """Further refusals of a config (raising :class:`ModelParallelError`)."""
    attention_dropout: str | None = None
    """The config field of the dropout on the attention probabilities."""
    dropout_in: str | None = None
    """The module of a layer whose forward's one dropout call is that on the attention
    probabilities (the attention module, or the dropout module itself): above 0 at tp > 1 its
    masks are drawn for every head (:class:`HeadDropout`)."""
    split_dropout: tuple[str, str] | None = None
    """A module of a layer whose forward's one dropout acts on features split over the tp group
    (T5's feed-forward, between ``wi`` and ``wo``), and the config field of its probability:
    above 0 at tp > 1 its mask is drawn for all the features and sliced, as heads' are."""
    bases: tuple[str, ...] = ()
    """Submodules of HF's ``base_model`` split as base models, each its own scaled-batch region
    (T5's ``encoder`` and ``decoder``); none of them there (or none named): ``base_model``."""
    inputs: tuple[str, ...] = BATCH_INPUTS
    """Base-model inputs holding the batch's rows, gathered over the tp group; the first is
    required (or ``input_ids``) and its rows are the rank's."""
    word_embedding: bool = True
    """The base model embeds ``input_ids`` with its input embedding, run on the rank's own rows
    before the region (a head may be tied to it); False: it embeds its inputs inside the
    region (ViT's patches)."""

    @property
    def what(self) -> str:
        return f"smp.nn.huggingface.{self.name}"


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
            if _matches(path, f"{family.layers}.{name}"):
                setattr(module, attribute, getattr(module, attribute) // degree)
    for path, layer in base.named_modules():  # one by one: made one at a time if delayed
        if _matches(path, family.layers):
            shards.parallelize(layer, _layer_plan(family, layer), family.what)
        elif dropping and _matches(path, f"{family.layers}.{family.dropout_in}"):
            _per_head(layer, rank, degree, family.what)
        elif split_dropout and _matches(path, f"{family.layers}.{split_dropout[0]}"):
            _per_head(layer, rank, degree, family.what, dim=-1)
    shards.mark_block(base)
    if embedding is not None:
        mark_scaled_batch(embedding, False)  # the rank's own rows, before the region
    whole_state_dicts(base)
    base.forward = _region(base, embedding, family)


def check_names(
    base: nn.Module, family: Family, dropping: bool, split_dropout: tuple[str, str] | None
) -> None:
    """Refuse ``base`` unless ``family``'s names find its layers, a column- and a row-wise
    linear in each and, where its dropout is drawn per head (``dropping``, ``split_dropout``),
    a module to draw it in for each layer: HF renames modules between versions, and a name
    that no longer matches would leave layers unsplit, or heads dropped unlike one process."""
    layers = [layer for path, layer in base.named_modules() if _matches(path, family.layers)]
    if not layers:
        _renamed(family, f"no module of {type(base).__name__} matches {family.layers!r}")
    for layer in layers:
        plan = _layer_plan(family, layer)
        for style in (ColwiseParallel, RowwiseParallel):
            if not any(type(entry) is style for entry in plan.values()):
                names = family.colwise if style is ColwiseParallel else family.rowwise
                _renamed(family, f"no module of {type(layer).__name__} matches any of {names}")
    drawn = [f"{family.layers}.{family.dropout_in}"] if dropping else []
    if split_dropout is not None:
        drawn.append(f"{family.layers}.{split_dropout[0]}")
    for pattern in drawn:
        found = sum(_matches(path, pattern) for path, _ in base.named_modules())
        if found < len(layers):
            _renamed(
                family,
                f"{found} modules of {type(base).__name__} match {pattern!r}, where its dropout "
                f"is drawn per head, for {len(layers)} layers",
            )


def _renamed(family: Family, why: str) -> None:
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    raise ModelParallelError(
        f"{family.what}: {why}: this transformers version ({version}) names its modules "
        "otherwise than the split knows; use another transformers version, or leave the model "
        "undistributed"
    )


def attention_dropout(config: Any, family: Family, degree: int) -> float:
    """The probability of the family's dropout on the attention probabilities. Above 0 at
    tp > 1 HF's eager attention is needed: it draws the mask with ``torch``'s dropout, which
    :class:`HeadDropout` draws for every head; SDPA, FlashAttention and flex attention draw
    theirs inside the kernel, for the rank's heads only, and on GPUs by the kernel's own
    scheme, so no rank can draw the mask one process would. Refused before the first step,
    naming the field and the implementation."""
    name = family.attention_dropout
    probability = float(getattr(config, name, 0.0) or 0.0) if name is not None else 0.0
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if degree > 1 and probability and implementation != "eager":
        raise ModelParallelError(
            f"{family.what}: config.{name}={probability} with "
            f"attn_implementation={implementation!r} is not supported at "
            f"tensor_parallel_degree {degree}: {implementation} draws the dropout mask of the "
            "rank's heads inside its kernel, unlike the one a single process draws for all "
            "heads; allowed: attn_implementation='eager' (an argument of from_pretrained / "
            "from_config, or model.set_attn_implementation('eager') before wrapping), or "
            f"{name}=0 in the config the model is created from"
        )
    return probability


class HeadDropout(TorchFunctionMode):
    """The attention probabilities' dropout of a split HF model, drawn as one process draws
    it: HF's attention calls ``torch.nn.functional.dropout`` on ``[rows, heads, query, key]``
    probabilities of the rank's heads, and would draw one mask for them, the same on every
    rank of the group (their generator is the region's, alike on all). Here the rank draws the
    mask of every head of the layer instead (the shape one process draws, from the same
    generator, so the same values) and keeps its own heads' slice. The region's rows are the
    group's combined batch, one process's batch. The cost is the draw of the other ranks'
    heads, and their mask held until it is sliced. With ``dim=-1`` the same for a dropout on
    features split over the group (:attr:`Family.split_dropout`)."""

    def __init__(self, rank: int, degree: int, what: str, dim: int = 1) -> None:
        super().__init__()
        self.rank, self.degree, self.what, self.dim = rank, degree, what, dim
        self.drawn = False
        """Whether a training dropout was drawn here (:func:`_per_head` requires one)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if dropout:
                raise ModelParallelError(
                    f"{self.what}: scaled_dot_product_attention with dropout_p={dropout} at "
                    f"tensor_parallel_degree {self.degree}: it draws the mask of the rank's "
                    "heads inside its kernel, unlike one process; the attention implementation "
                    "must stay 'eager' after the model is wrapped (set_attn_implementation)"
                )
        if func is not F.dropout or not kwargs["training"]:
            return func(*args, **kwargs)
        self.drawn = True
        if not kwargs["p"]:
            return func(*args, **kwargs)
        probs = args[0]
        if self.dim == 1 and probs.dim() != 4:
            raise ModelParallelError(
                f"{self.what}: the attention dropout met a tensor of shape {list(probs.shape)}, "
                "where [rows, heads, query, key] probabilities were expected (a transformers "
                "version this split does not know)"
            )
        heads = probs.shape[self.dim]
        whole = list(probs.shape)
        whole[self.dim] = heads * self.degree
        noise = F.dropout(probs.new_ones(whole), p=kwargs["p"])  # 0 or 1/(1-p), as torch's
        mine = noise.narrow(self.dim, self.rank * heads, heads).contiguous()  # frees the others'
        return probs.mul_(mine) if kwargs["inplace"] else probs * mine


def _per_head(module: nn.Module, rank: int, degree: int, what: str, dim: int = 1) -> None:
    """Make ``module``'s forward (of :attr:`Family.dropout_in`) draw its dropout by
    :class:`HeadDropout`. A training forward that draws none dropped elsewhere (an attention
    implementation switched after wrapping, a transformers version calling other code): it fails,
    naming the module, rather than train unlike one process."""
    forward = module.forward

    @functools.wraps(forward)
    def dropping(*args: Any, **kwargs: Any) -> Any:
        drawing = HeadDropout(rank, degree, what, dim)
        with drawing:
            out = forward(*args, **kwargs)
        if module.training and not drawing.drawn:
            raise ModelParallelError(
                f"{what}: {type(module).__name__}'s forward drew no dropout in training, where "
                f"its dropout is drawn per head at tensor_parallel_degree {degree}: it ran "
                "another attention implementation (keep 'eager' after wrapping: "
                "set_attn_implementation) or code of a transformers version the split does "
                "not know"
            )
        return out

    module.forward = dropping


def _layer_plan(family: Family, layer: nn.Module) -> dict[str, ParallelStyle]:
    """How ``layer``, one of ``family``'s transformer layers, is split: a fresh style for each of
    its modules that the family's names match (patterns: T5's encoder and decoder blocks differ,
    and so do its feed-forwards, gated or not)."""
    plan: dict[str, ParallelStyle] = {}
    for names, style in ((family.colwise, ColwiseParallel), (family.rowwise, RowwiseParallel)):
        for path, _ in layer.named_modules():
            if any(_matches(path, name) for name in names):
                plan[path] = style()
    return plan


def _matches(path: str, pattern: str) -> bool:
    """Whether module ``path`` matches ``pattern`` name by name (as ``parallelize_module``'s
    plan keys do: ``*`` stands for one name)."""
    parts, wanted = path.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(map(fnmatch, parts, wanted))


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

"""What a Hugging Face family's in-place split needs to know, shared by SMP v1's split
(:mod:`.inplace`) and SMP v2's ``torch.sagemaker.transform`` (:mod:`dtrain.smpv2.transform`).

A :class:`Family` names its transformer layers and which of their linear layers split by output
features (column-wise) or by input features (row-wise): :func:`layer_plan` turns that into
torch's parallel styles for one layer, :func:`check_names` refuses a model whose modules the
names no longer find (HF renames between versions). The attention dropout of a split layer is
drawn for every head, as one process draws it (:func:`attention_dropout`, :class:`HeadDropout`,
:func:`per_head`). Nothing here reads a runtime's state: the tp rank and degree are arguments.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.overrides import TorchFunctionMode

from dtrain.modelparallel.errors import ModelParallelError

BATCH_INPUTS = ("inputs_embeds", "attention_mask", "token_type_ids", "position_ids")
"""Base-model inputs holding the batch's rows, gathered over the tp group (``position_ids`` of
one row, shared by the batch, stays as it is); the first leads (:attr:`Family.inputs`)."""


@dataclass(frozen=True)
class Family:
    """What differs between the families: layer names, size fields, head-count attributes."""

    name: str
    """SMP's name, ``smp.nn.huggingface.<name>``; errors name it under :attr:`api`."""
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
    api: str = "smp.nn.huggingface"
    """The API that splits it, naming it in errors (SMP v1's module of the family, or SMP v2's
    ``torch.sagemaker.transform``)."""

    @property
    def what(self) -> str:
        return f"{self.api}.{self.name}"


def check_names(
    base: nn.Module, family: Family, dropping: bool, split_dropout: tuple[str, str] | None
) -> None:
    """Refuse ``base`` unless ``family``'s names find its layers, a column- and a row-wise
    linear in each and, where its dropout is drawn per head (``dropping``, ``split_dropout``),
    a module to draw it in for each layer: HF renames modules between versions, and a name
    that no longer matches would leave layers unsplit, or heads dropped unlike one process."""
    layers = [layer for path, layer in base.named_modules() if matches(path, family.layers)]
    if not layers:
        _renamed(family, f"no module of {type(base).__name__} matches {family.layers!r}")
    for layer in layers:
        plan = layer_plan(family, layer)
        for style in (ColwiseParallel, RowwiseParallel):
            if not any(type(entry) is style for entry in plan.values()):
                names = family.colwise if style is ColwiseParallel else family.rowwise
                _renamed(family, f"no module of {type(layer).__name__} matches any of {names}")
    drawn = [f"{family.layers}.{family.dropout_in}"] if dropping else []
    if split_dropout is not None:
        drawn.append(f"{family.layers}.{split_dropout[0]}")
    for pattern in drawn:
        found = sum(matches(path, pattern) for path, _ in base.named_modules())
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
    rank of the group (their generator is alike on all). Here the rank draws the mask of every
    head of the layer instead (the shape one process draws, from the same generator, so the
    same values) and keeps its own heads' slice. The rows are those one process sees: SMP v1's
    region holds the group's combined batch, SMP v2's tp ranks share one batch. The cost is the
    draw of the other ranks' heads, and their mask held until it is sliced. With ``dim=-1`` the
    same for a dropout on features split over the group (:attr:`Family.split_dropout`)."""

    def __init__(self, rank: int, degree: int, what: str, dim: int = 1) -> None:
        super().__init__()
        self.rank, self.degree, self.what, self.dim = rank, degree, what, dim
        self.drawn = False
        """Whether a training dropout was drawn here (:func:`per_head` requires one)."""

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


def per_head(module: nn.Module, rank: int, degree: int, what: str, dim: int = 1) -> None:
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


def layer_plan(family: Family, layer: nn.Module) -> dict[str, ParallelStyle]:
    """How ``layer``, one of ``family``'s transformer layers, is split: a fresh style for each of
    its modules that the family's names match (patterns: T5's encoder and decoder blocks differ,
    and so do its feed-forwards, gated or not)."""
    plan: dict[str, ParallelStyle] = {}
    for names, style in ((family.colwise, ColwiseParallel), (family.rowwise, RowwiseParallel)):
        for path, _ in layer.named_modules():
            if any(matches(path, name) for name in names):
                plan[path] = style()
    return plan


def matches(path: str, pattern: str) -> bool:
    """Whether module ``path`` matches ``pattern`` name by name (as ``parallelize_module``'s
    plan keys do: ``*`` stands for one name)."""
    parts, wanted = path.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(map(fnmatch, parts, wanted))

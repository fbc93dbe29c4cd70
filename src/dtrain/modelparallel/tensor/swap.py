"""Swapping marked modules for their distributed counterparts, with the same weights.

``smp.DistributedModel`` calls :func:`distribute` when ``tensor_parallel_degree`` is above 1.
Every module marked enabled (:mod:`.marks`) whose class is registered is rebuilt as its
distributed module from its constructor arguments (``init_hook`` applied, then the marking
context's arguments that the distributed module accepts), takes the original's weights (rank
0's) when their state-dict keys agree (a built-in swap always does; otherwise it keeps its own
initialization, as SMP's do), and gets the registration's forward and return hooks. Its
submodules are not visited: the distributed module replaces all of it. A Hugging Face model of
a family :mod:`.huggingface.inplace` knows is not rebuilt but split in place, whole.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from dtrain.modelparallel import deferred, state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import activations
from dtrain.modelparallel.tensor import marks, translated
from dtrain.modelparallel.tensor.averages import is_scaled_batch
from dtrain.modelparallel.tensor.embedding import DistributedEmbedding
from dtrain.modelparallel.tensor.huggingface import inplace
from dtrain.modelparallel.tensor.linear import DistributedLinear
from dtrain.modelparallel.tensor.module import DistributedModule


def _linear_args(layer: nn.Linear) -> marks.Args:
    return (layer.in_features, layer.out_features), {"bias": layer.bias is not None}


def _embedding_args(table: nn.Embedding) -> marks.Args:
    kwargs = {"padding_idx": table.padding_idx, "max_norm": table.max_norm}
    kwargs.update(norm_type=table.norm_type, scale_grad_by_freq=table.scale_grad_by_freq)
    return (table.num_embeddings, table.embedding_dim), {**kwargs, "sparse": table.sparse}


BUILT_IN: dict[type[nn.Module], tuple[marks.Registration, Any]] = {
    nn.Linear: (marks.Registration(DistributedLinear), _linear_args),
    nn.Embedding: (marks.Registration(DistributedEmbedding), _embedding_args),
}
"""Classes SMP distributes without a registration: the distributed class and how to read an
instance's constructor arguments back from it."""

HUGGING_FACE = {
    "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel": "gpt2",
    "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXForCausalLM": "gptneox",
    "transformers.models.gptj.modeling_gptj.GPTJForCausalLM": "gptj",
}
"""Hugging Face classes by qualified name → their module in :mod:`.huggingface` (imported when
a model of the class is seen, so ``transformers`` is never imported for nothing). A class of a
family split in place (:mod:`.huggingface.inplace`) is translated only with SMP's
distributed-transformer intent (:func:`_translates`)."""


def _hugging_face(kind: type[nn.Module]) -> ModuleType | None:
    """The :mod:`.huggingface` module translating Hugging Face's class ``kind``, or None."""
    name = HUGGING_FACE.get(f"{kind.__module__}.{kind.__qualname__}")
    if name is None:
        return None
    return importlib.import_module(f"dtrain.modelparallel.tensor.huggingface.{name}")


def _built_in(kind: type[nn.Module]) -> tuple[marks.Registration, Any] | None:
    if kind in BUILT_IN:
        return BUILT_IN[kind]
    translation = _hugging_face(kind)
    if translation is None:
        return None
    return translation.REGISTRATION, translation.args_of


def _family(kind: type[nn.Module]) -> inplace.Family | None:
    """The family of an HF model class split in place (:mod:`.huggingface.inplace`), or None."""
    name = inplace.family_of(kind)
    if name is None:
        return None
    return importlib.import_module(f"dtrain.modelparallel.tensor.huggingface.{name}").FAMILY


def distribute(root: nn.Module) -> nn.Module:
    """Swap the marked modules under ``root`` (``root`` too); the root afterwards."""
    _keep_inside_distributed(root)
    _refuse_untying(root)
    done: dict[int, nn.Module] = {}

    def visit(module: nn.Module, path: str) -> nn.Module:
        if id(module) in done:  # shared by two parents: swapped once
            return done[id(module)]
        try:
            swapped = _swapped(module, path)
            if swapped is not None and swapped is not module:  # split in place: marks stay
                activations.carry_over(module, swapped)
        except ModelParallelError as exc:
            where = f"module {path!r}" if path else "the model"
            raise ModelParallelError(
                f"smp.DistributedModel: {where} ({type(module).__name__}) cannot be "
                f"distributed: {exc}"
            ) from exc
        if swapped is None:
            for name, child in list(module._modules.items()):  # shared ones under each name
                if child is None:
                    continue
                new = visit(child, f"{path}.{name}" if path else name)
                if new is not child:
                    setattr(module, name, new)
            swapped = module
        done[id(module)] = swapped
        return swapped

    root = visit(root, "")
    degree = state.current("smp.DistributedModel").tp_size
    if degree > 1 and not any(is_scaled_batch(p) for p in root.parameters()):
        warnings.warn(
            f"smp.DistributedModel: tensor_parallel_degree={degree}, but no module of the model "
            "is distributed (none was created inside smp.tensor_parallelism() or marked with "
            "smp.set_tensor_parallelism, or none of those has a distributed counterpart): every "
            "rank of a tensor-parallel group computes the whole model",
            stacklevel=3,
        )
    return root


def _keep_inside_distributed(root: nn.Module) -> None:
    """The layers an ``smp.nn`` module builds (its embeddings, its tied head) are its own, made
    inside ``smp.tensor_parallelism()`` as it was: never swapped."""
    for module in root.modules():
        if isinstance(module, (DistributedModule, DistributedLinear, DistributedEmbedding)):
            for inner in list(module.modules())[1:]:
                marks.set_tensor_parallelism(inner, enabled=False)


def _swaps(module: nn.Module) -> bool:
    """Whether :func:`distribute` replaces ``module`` (its mark, and a distributed class)."""
    mark = marks.mark_of(module)
    if mark is None or not mark.enabled:
        return False
    kind = type(module)
    if kind in marks.registered() or _family(kind) is not None:
        return True
    return _built_in(kind) is not None and not _not_honoured(module)


def _not_honoured(module: nn.Module) -> dict[str, Any]:
    """The arguments of ``module``, of a class swapped without a registration (``nn.Linear``,
    ``nn.Embedding``), that its distributed class implements at other values only (an
    embedding's ``max_norm``). SMP leaves a module it cannot distribute as it is; so does the
    swap, with a warning (an ``smp.nn`` module created with them fails)."""
    built_in = BUILT_IN.get(type(module))
    if built_in is None or type(module) in marks.registered():
        return {}
    registration, read_args = built_in
    only = getattr(registration.dist_module, "IMPLEMENTED_ONLY", {})
    _, keywords = read_args(module)
    return {key: value for key, value in keywords.items() if key in only and value != only[key]}


def _refuse_untying(root: nn.Module) -> None:
    """A parameter that modules on both sides of a swap share (a head tied to an embedding,
    one distributed, the other not, or by another distributed module) would become two that
    train apart: that fails, naming both, before anything is swapped."""
    first_use: dict[int, tuple[str, int | None, str]] = {}

    def walk(module: nn.Module, path: str, swapped: tuple[int, str] | None) -> None:
        if swapped is None and _swaps(module):
            swapped = (id(module), path or "the model")
        for name, param in module.named_parameters(recurse=False):
            where = f"{path}.{name}" if path else name
            by = None if swapped is None else swapped[0]
            label = "kept as it is" if swapped is None else f"distributed as {swapped[1]!r}"
            seen = first_use.setdefault(id(param), (where, by, label))
            if seen[1] != by:
                raise ModelParallelError(
                    f"smp.DistributedModel: parameters {seen[0]!r} ({seen[2]}) and {where!r} "
                    f"({label}) are one tensor; swapping would untie them, and they would train "
                    "apart. Distribute both within one module, or neither "
                    "(smp.set_tensor_parallelism(module, enabled=False))"
                )
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{path}.{name}" if path else name, swapped)

    walk(root, "", None)


def _swapped(module: nn.Module, path: str) -> nn.Module | None:
    """``module``'s distributed module, or None if it stays (``path`` names it)."""
    mark = marks.mark_of(module)
    if mark is None or not mark.enabled:
        return None
    kind = type(module)
    registration = marks.registered().get(kind)
    args = marks.init_args_of(module)
    family = _family(kind) if registration is None and not _translates(kind, mark) else None
    if family is not None:  # its own layers split in place, each made when split if delayed
        return inplace.parallelize(module, family, mark.options)
    built_in = _built_in(kind) if registration is None else None
    not_honoured = _not_honoured(module)
    if not_honoured:
        given = ", ".join(f"{key}={value!r}" for key, value in not_honoured.items())
        warnings.warn(
            f"smp.DistributedModel: module {path or 'the model'!r} ({kind.__name__}) is kept as "
            f"it is, not distributed: {BUILT_IN[kind][0].dist_module.__name__} does not "
            f"implement {given}",
            stacklevel=4,
        )
        return None
    if built_in is not None:
        registration, read_args = built_in
        args = read_args(module)
    if registration is None:
        return None
    if args is None:
        raise TypeError(
            f"smp.tp_register: {kind.__name__} was created before its registration, so its "
            "constructor arguments are unknown; register it before creating the model"
        )
    positional, keywords = args
    if registration.init_hook is not None:
        positional, keywords = registration.init_hook(*positional, **keywords)
    keywords = {**keywords, **_accepted(registration.dist_module, mark.options)}
    dist = _created_as(module, lambda: registration.dist_module(*positional, **keywords))
    hugging_face = _hugging_face(kind) if built_in is not None else None
    translation = None
    if hugging_face is not None:  # by the model's own config (GPT-NeoX's head count)
        to_hf, from_hf = hugging_face.translations(module.config)
        translation = translated.Translation(kind.__name__, to_hf, from_hf)
        translated.record(dist, translation)  # full checkpoints translate both ways too
    _copy_weights(module, dist, translation.from_hf if translation is not None else None)
    dist.train(module.training)
    forward_hook, return_hook = registration.forward_hook, registration.return_hook
    if forward_hook is not None:
        dist.register_forward_pre_hook(lambda _m, a, k: forward_hook(*a, **k), with_kwargs=True)
    if return_hook is not None:
        dist.register_forward_hook(lambda _m, _a, out: return_hook(out))
    return dist


def _translates(kind: type[nn.Module], mark: marks.Mark) -> bool:
    """Whether a model of a family split in place that SMP translates (GPT-NeoX's and GPT-J's
    causal LMs) becomes SMP's ``DistributedTransformerLMHead``: its mark says
    ``zero_init=False``, which AWS's scripts pass exactly when they use the distributed
    transformer (``zero_init=True``, or none, keeps HF's own modules, split in place)."""
    translated = f"{kind.__module__}.{kind.__qualname__}" in HUGGING_FACE
    return translated and mark.options.get("zero_init", True) is False


def _created_as(original: nn.Module, create: Callable[[], nn.Module]) -> nn.Module:
    """``create()`` with the default dtype the floating parameters of ``original`` have (a
    model made inside ``smp.model_creation(dtype=...)`` keeps it when swapped)."""
    dtypes = {p.dtype for p in original.parameters() if p.is_floating_point()}
    previous = torch.get_default_dtype()
    if len(dtypes) == 1:
        torch.set_default_dtype(dtypes.pop())
    try:
        return create()
    finally:
        torch.set_default_dtype(previous)


def _accepted(dist_module: type[nn.Module], options: dict[str, Any]) -> dict[str, Any]:
    """The marking context's arguments that ``dist_module``'s constructor takes (all of them
    when it takes ``**kwargs``, which then say which they refuse)."""
    parameters = inspect.signature(dist_module).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(options)
    names = {p.name for p in parameters}
    return {key: value for key, value in options.items() if key in names}


def _made(module: nn.Module) -> None:
    """A module created without memory made whole (with its eager values) before it is
    swapped: the one module whole at a time."""
    tensors = [*module.parameters(), *module.buffers()]
    deferred.materialize(tensors, state.current("smp.DistributedModel").device)


def _copy_weights(
    original: nn.Module,
    dist: nn.Module,
    translate: Callable[[dict[str, Any]], dict[str, Any]] | None,
) -> None:
    _made(original)
    if translate is not None:
        dist.load_state_dict(translate(original.state_dict()))
        return
    if translated.state_keys(original) == translated.state_keys(dist):
        dist.load_state_dict(original.state_dict())
        return
    warnings.warn(
        f"smp.tensor_parallelism: {type(dist).__name__} replacing {type(original).__name__} "
        "has other parameter names, so it keeps its own initialization",
        stacklevel=3,
    )

"""``torch.sagemaker.transform``: a Hugging Face model made tensor-parallel in place, on DTensor.

SMP v2 swaps the layers of GPT-NeoX, Llama, Mistral and Mixtral models for Transformer Engine's;
dtrain keeps Hugging Face's modules, names and forward, and splits their weights over the tp
mesh with torch's parallel styles, as SMP v1's in-place split does (:mod:`.families`). The ranks
of a tp group read the same batch (AWS's scripts give them one data-parallel rank), so this is
Megatron's layout with nothing around it:

* each layer's query, key, value and the feed-forward's first linears split by output features,
  the attention's output and the feed-forward's last by input features (one all-reduce each in
  forward, one for the input's gradient in backward);
* the input embedding splits by vocabulary rows, its output summed over the group; the output
  embedding (the LM head) splits by vocabulary rows too and gathers its logits, so HF's own loss
  sees them whole; tied embeddings stay tied;
* everything else (norms, rotary tables, Mixtral's experts) stays whole on every tp rank.

A split parameter is a DTensor on the tp mesh (``Shard`` or ``Replicate``), the others plain
tensors: FSDP2's ``fully_shard`` over the data-parallel dimensions of the same root mesh shards
both (torch's 2-D layout); FSDP1 takes them with ``device_mesh`` set to those dimensions, whose
root is the tp mesh's. ``state_dict()`` keeps HF's names (split tensors as DTensors, whole
through torch's ``get_model_state_dict(..., full_state_dict=True)``), and ``load_state_dict``
takes a whole HF state dict as well as a split one.

An eager model's split weights are those of the tp group's first rank (torch's styles scatter
them), and so are its whole ones (broadcast here): every rank of a group holds one model. A
model on the meta device is split without memory, to be made by
:class:`~dtrain.smpv2.delayed_param.DelayedParamIniter`; with ``load_state_dict_from_rank0``
the tp group of rank 0 takes rank 0's weights (:mod:`.rank0`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import shards
from dtrain.modelparallel.tensor.dtensors import local
from dtrain.modelparallel.tensor.huggingface.family import (
    Family,
    attention_dropout,
    check_names,
    layer_plan,
    matches,
    per_head,
)
from dtrain.modelparallel.tensor.module import split_over
from dtrain.smpv2 import rank0
from dtrain.smpv2.families import REPLICATED, WHAT, family_of
from dtrain.smpv2.layer import make_transformer_layer

TRANSFORMED = "_dtrain_transformed"
"""The attribute marking a transformed model (a second transform is refused)."""

CP_COMM_TYPES = ("p2p", "all_gather")

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # imported only with a model of its own


def transform(
    model: nn.Module,
    mesh: DeviceMesh | None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    config: Any = None,
    load_state_dict_from_rank0: bool = False,
    cp_comm_type: str = "p2p",
    context_parallel_degree: int = 1,
) -> nn.Module:
    """Split HF model ``model`` in place over the one-dimensional tp ``mesh`` (``None``, or a
    mesh of one rank: nothing split) and return it; its layers become
    :class:`~dtrain.smpv2.layer.TransformerLayer` instances at any degree. Every rank of the
    mesh calls it. ``device`` and ``dtype`` place a model that is not on the meta device (the
    parameters' dtype only: HF keeps its rotary tables in float32); ``config``,
    ``cp_comm_type`` and ``context_parallel_degree`` are SMP's, of which only the dense path
    without context parallelism is built."""
    family = family_of(model)
    hf = cast("PreTrainedModel", model)
    degree = _checked_degree(hf, family, mesh, config, cp_comm_type, context_parallel_degree)
    dropping = degree > 1 and attention_dropout(hf.config, family, degree) > 0
    base = hf.base_model
    check_names(base, family, dropping, None)
    meta = any(tensor.is_meta for _, tensor in rank0.named_tensors(model))
    _place(model, None if meta else device, dtype)
    whole = None
    if mesh is not None and degree > 1:
        _check_meta_agrees(mesh, meta, load_state_dict_from_rank0)
        if load_state_dict_from_rank0 and dist.get_rank() == 0:
            whole = dict(rank0.named_tensors(model))
        eager = not meta and not load_state_dict_from_rank0
        _split(hf, base, family, mesh, eager, dropping)
        if eager:
            _broadcast_whole(model, mesh)
        if load_state_dict_from_rank0 and rank0.holds_rank0(mesh):
            rank0.load_from_rank0(model, whole, mesh)
    for path, layer in list(base.named_modules()):
        if matches(path, family.layers):
            make_transformer_layer(layer)
    for module in model.modules():  # each split module too: FSDP1 units load under other paths
        if module is model or any(isinstance(p, DTensor) for p in module.parameters(False)):
            module.register_load_state_dict_pre_hook(shards.shard_load_hook)
    setattr(model, TRANSFORMED, True)
    return model


def _checked_degree(
    model: PreTrainedModel,
    family: Family,
    mesh: DeviceMesh | None,
    config: Any,
    cp_comm_type: str,
    context_parallel_degree: int,
) -> int:
    """The tp degree, once ``model`` is known to split over it and SMP's other arguments ask
    for nothing dtrain does not build; anything else fails by name."""
    _refuse_unbuilt(config, cp_comm_type, context_parallel_degree)
    if getattr(model, TRANSFORMED, False):
        raise ModelParallelError(f"{WHAT}: the model is transformed already; transform it once")
    if mesh is not None and mesh.ndim != 1:
        raise ModelParallelError(f"{WHAT}: the tp mesh must have one dimension, got {mesh.ndim}")
    if family.check is not None:
        family.check(model.config)
    degree = 1 if mesh is None else mesh.size()
    for name in family.sizes:
        size = getattr(model.config, name, None)
        if size is not None:
            split_over(family.what, name, size, degree)
    return degree


def _refuse_unbuilt(config: Any, cp_comm_type: str, context_parallel_degree: int) -> None:
    """SMP's arguments for what dtrain does not build yet, refused by name."""
    if config is not None:
        raise ModelParallelError(
            f"{WHAT}: config={config!r} (the configuration of SMP's mixture-of-experts layer) is "
            "not available yet in dtrain; pass config=None: a Mixtral model's experts then stay "
            "whole on every tensor-parallel rank"
        )
    if cp_comm_type not in CP_COMM_TYPES:
        raise ModelParallelError(
            f"{WHAT}: cp_comm_type={cp_comm_type!r}; allowed: {', '.join(CP_COMM_TYPES)}"
        )
    if context_parallel_degree != 1:
        raise ModelParallelError(
            f"{WHAT}: context_parallel_degree={context_parallel_degree}: context parallelism is "
            "not available yet in dtrain; allowed: 1"
        )


def _place(model: nn.Module, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
    """Move ``model`` to ``device`` and its floating parameters to ``dtype`` (ties kept)."""
    if device is not None:
        model.to(device)
    if dtype is not None:
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)


def _check_meta_agrees(mesh: DeviceMesh, meta: bool, from_rank0: bool) -> None:
    """The ranks of a tp group split one model: all eager (the first rank's weights are
    scattered) or all on the meta device, unless rank 0 sends its weights to its group, whose
    other ranks may be on meta; rank 0 may not. Every rank of the group learns of a mismatch
    (one collective), so all of them fail, naming the ranks."""
    group = mesh.get_group()
    flags = [torch.zeros(1, device=mesh.device_type) for _ in range(mesh.size())]
    dist.all_gather(flags, torch.tensor([float(meta)], device=mesh.device_type), group=group)
    ranks = dist.get_process_group_ranks(group)
    on_meta = [rank for rank, flag in zip(ranks, flags, strict=True) if flag.item()]
    if from_rank0:
        if 0 in on_meta:
            raise ModelParallelError(
                f"{WHAT}: load_state_dict_from_rank0=True, but rank 0's model is on the meta "
                "device; create it with its weights on rank 0 (delayed creation on the other "
                "ranks only)"
            )
    elif on_meta and len(on_meta) < len(ranks):
        raise ModelParallelError(
            f"{WHAT}: ranks {on_meta} of tp group {ranks} created the model on the meta device "
            "and the others eagerly; create it alike on every rank, or pass "
            "load_state_dict_from_rank0=True to send rank 0's weights"
        )


def _split(
    model: PreTrainedModel,
    base: nn.Module,
    family: Family,
    mesh: DeviceMesh,
    eager: bool,
    dropping: bool,
) -> None:
    """Split the layers, the embeddings and the head of ``model`` over ``mesh``: an ``eager``
    model from the group's first rank's weights, any other where it is (no communication)."""
    source = 0 if eager else None
    ties = _ties(model)
    rank, degree = mesh.get_local_rank(), mesh.size()
    replicated = REPLICATED.get(family.name)
    for path, module in list(base.named_modules()):
        if matches(path, family.layers):
            parallelize_module(module, mesh, layer_plan(family, module), src_data_rank=source)
        elif dropping and matches(path, f"{family.layers}.{family.dropout_in}"):
            per_head(module, rank, degree, family.what)
        elif replicated and matches(path, f"{family.layers}.{replicated}"):
            warnings.warn(
                f"{family.what}: each layer's {replicated} (its mixture of experts) stays whole "
                f"on every one of the {degree} tensor-parallel ranks: expert parallelism is not "
                "available yet in dtrain",
                stacklevel=3,
            )
            replicated = None  # said once
    embedding = _linear_or_embedding(model.get_input_embeddings(), nn.Embedding, "input")
    parallelize_module(
        embedding, mesh, RowwiseParallel(input_layouts=Replicate()), src_data_rank=source
    )
    head = model.get_output_embeddings()
    if head is not None:
        head = _linear_or_embedding(head, nn.Linear, "output")
        plan = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(head, mesh, plan, src_data_rank=source)
    _retie(ties)


def _linear_or_embedding(module: nn.Module, kind: type[nn.Module], which: str) -> nn.Module:
    if not isinstance(module, kind):
        raise ModelParallelError(
            f"{WHAT}: the model's {which} embedding is a {type(module).__name__}; the split "
            f"knows {kind.__name__}"
        )
    return module


Tie = list[tuple[nn.Module, str]]


def _ties(model: nn.Module) -> list[Tie]:
    """The places that share one parameter (a head tied to the input embedding): torch's
    styles give each place its own parameter."""
    places: dict[int, Tie] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module, name))
    return [tie for tie in places.values() if len(tie) > 1]


def _retie(ties: list[Tie]) -> None:
    """One parameter at every place of each tie again: the first place's, split as the others
    (a tie split two ways cannot be kept, and fails naming its places)."""
    for (first, first_name), *others in ties:
        kept = getattr(first, first_name)
        for module, name in others:
            split = getattr(module, name)
            if _layout(split) != _layout(kept):
                raise ModelParallelError(
                    f"{WHAT}: {type(first).__name__}.{first_name} and {type(module).__name__}."
                    f"{name} are one parameter, split two ways ({_layout(kept)}, "
                    f"{_layout(split)}); untie them"
                )
            setattr(module, name, kept)


def _layout(tensor: Tensor) -> str:
    return str(tensor.placements) if isinstance(tensor, DTensor) else "whole"


def _broadcast_whole(model: nn.Module, mesh: DeviceMesh) -> None:
    """The tensors every rank holds whole (norms, rotary tables, experts) as the group's first
    rank holds them, as torch's styles give the split ones: one model per tp group."""
    for _, tensor in rank0.named_tensors(model):
        if not isinstance(tensor, DTensor):
            sent = distribute_tensor(tensor.detach(), mesh, (Replicate(),), src_data_rank=0)
            local(tensor).data.copy_(sent.to_local())

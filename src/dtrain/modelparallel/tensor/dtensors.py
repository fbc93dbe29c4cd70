"""A tensor that may be a DTensor: its local part, its whole value, and values laid out as it.

Tensor parallelism splits parameters over the tp group and sharded data parallelism over the
shard group (FSDP2), both as DTensors; a parameter, a master, a gradient or an optimizer state
may then be one. Everything else (state dicts, optimizer states, loss scaling) goes through
these helpers, which treat a plain tensor as a DTensor of one rank.

Importing DTensor takes a second, and a model without either holds none: nothing here imports
it until a DTensor is given (:func:`is_distributed` asks ``sys.modules``: none exists before
``torch.distributed.tensor`` is imported).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from dtrain.modelparallel.errors import ModelParallelError

if TYPE_CHECKING:  # annotations only: neither is imported when running
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs


def is_distributed(tensor: Any) -> TypeIs[DTensor]:
    """Whether ``tensor`` is a DTensor (a shard, or a replica kept by its mesh's ranks)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``, a plain tensor sharing its memory."""
    return tensor.to_local() if is_distributed(tensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of ``tensor`` on every rank of its mesh (a collective for a DTensor,
    such as a shard's norm or a partial sum)."""
    return tensor.full_tensor() if is_distributed(tensor) else tensor


def saved(value: Any, full: bool) -> Any:
    """A state value as a file keeps it, detached, on the CPU: a tensor's local part, or
    (``full``, a collective for a DTensor: every rank calls it in the same order) its whole
    value; any other value as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return (whole(value) if full else local(value)).detach().cpu()


def _narrowings(like: DTensor) -> list[tuple[int, int, int]]:
    """``(dim, start, length)``: the narrowings of ``like``'s whole value, in order, that leave
    this rank's part: along ``like``'s mesh dimensions from the last (a tp dimension) to the
    first, each ``torch.chunk``'s piece of this rank's coordinate (an empty one for a rank
    beyond the pieces), as DTensor and FSDP2 cut."""
    mesh = like.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "every rank is on the mesh of its parameters"
    sizes = list(like.shape)
    steps = []
    for dim in reversed(range(mesh.ndim)):
        along = getattr(like.placements[dim], "dim", None)
        if along is not None:  # Shard's and _StridedShard's
            size = sizes[along]
            chunk = -(-size // mesh.size(dim))
            start = min(coordinate[dim] * chunk, size)
            sizes[along] = min(chunk, size - start)
            steps.append((along, start, sizes[along]))
    return steps


def cut(what: str, like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``value``, the whole value of ``like`` (itself when ``like`` is not
    distributed), as a plain tensor (see :func:`_narrowings`). By hand, as
    ``distribute_tensor`` refuses a tp shard that the shard group splits unevenly (FSDP2's
    ``_StridedShard``), which FSDP2 itself allows. ``what`` names the value in errors."""
    _check_shape(what, value, like.shape, whole_value=True)
    if not is_distributed(like):
        return value
    part = value
    for along, start, length in _narrowings(like):
        part = part.narrow(along, start, length)
    return part


def offset(like: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's part of ``like`` begins in its whole value, along each dimension."""
    where = [0] * like.dim()
    if is_distributed(like):
        for along, start, _ in _narrowings(like):
            where[along] += start
    return tuple(where)


def _check_shape(what: str, value: torch.Tensor, shape: torch.Size, whole_value: bool) -> None:
    """A saved ``value`` must have ``shape``: the whole tensor's, or (not ``whole_value``) this
    rank's part's."""
    if value.shape == shape:
        return
    if whole_value:
        kind, hint = "full state dict, the parameter", ""
    else:
        kind = "partial state dict, this rank's part"
        hint = (
            ": a partial state loads only at the degrees it was saved at; save a full one "
            "(partial=False) to change them"
        )
    raise ModelParallelError(
        f"{what} has shape {tuple(value.shape)} in the {kind} {tuple(shape)}{hint}"
    )


def part_of(what: str, like: torch.Tensor, value: torch.Tensor, whole_value: bool) -> torch.Tensor:
    """This rank's part of a saved ``value`` shaped like ``like``: cut from the whole value, or
    (``whole_value`` false) the part it is, as ``local_state_dict`` saved it."""
    if whole_value:
        return cut(what, like, value)
    _check_shape(what, value, local(like).shape, whole_value=False)
    return value


def load_into(what: str, tensor: torch.Tensor, value: torch.Tensor, whole_value: bool) -> None:
    """Copy a saved ``value`` into ``tensor``'s local part (see :func:`part_of`)."""
    local(tensor).copy_(part_of(what, tensor, value, whole_value))


def laid_out_as(what: str, like: torch.Tensor, value: torch.Tensor, whole_value: bool) -> Any:
    """A saved ``value`` shaped like ``like`` (an optimizer state of parameter ``like``) laid
    out as ``like``: for a DTensor ``like``, a DTensor of this rank's part (see
    :func:`part_of`) on its device, floating values in its dtype; a DTensor ``value`` as it is
    (in that dtype); a value for a plain ``like`` as it is."""
    if not is_distributed(like):
        return value
    if is_distributed(value):
        return value.to(like.dtype) if value.is_floating_point() else value
    from torch.distributed.tensor import DTensor

    assert isinstance(like, DTensor)
    dtype = like.dtype if value.is_floating_point() else value.dtype
    part = part_of(what, like, value.to(like.device, dtype), whole_value)
    return DTensor.from_local(
        part, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )

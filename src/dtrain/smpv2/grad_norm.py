"""``torch.sagemaker.grad_norm.clip_grad_norm_``: gradient clipping by the norm of the whole
model's gradient, however it is split over ranks.

Under SMP v2 a rank holds pieces of the gradients: FSDP1's flat shards (a slice of several
parameters each), FSDP2's and tensor parallelism's DTensors, whole tensors replicated on every
rank. ``torch.nn.utils.clip_grad_norm_`` on one rank sees only its pieces; FSDP1's own
``clip_grad_norm_`` sums over its shard group but counts a tensor-parallel slice as the whole
parameter. Here each rank sums ``|g|^p`` over what it holds, dividing each piece by the number of
ranks holding a copy of it, and one all-reduce over the world adds the pieces: every element of
every gradient counted once, so the norm is one process's on the same global batch.

How many ranks hold a copy follows from how many distinct pieces the parameter is cut into:
every rank of SMP v2's world holds one piece of every parameter (no pipeline stages), so a
parameter cut into ``n`` pieces (FSDP1's shard group size times the tp slices its extension
records, or the product of a DTensor's sharded mesh dimensions) has ``world / n`` copies of each.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp._flat_param import FlatParameter
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial

from dtrain.smpv2.flat_params import flat_units, held_by_units

Piece = tuple[Tensor, int]
"""A gradient piece this rank holds, and into how many distinct pieces its parameter is cut."""


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """Scale every gradient of ``model`` so that their total norm is at most ``max_norm``; every
    rank calls it. Returns the total norm before clipping (a float32 scalar, as
    ``torch.nn.utils.clip_grad_norm_`` returns)."""
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    pieces = list(_pieces(model))
    device = pieces[0][0].device if pieces else torch.device("cpu")
    total = _total_norm(pieces, norm_type, device)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"{total.item()}; set error_if_nonfinite=False to clip anyway"
        )
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for local, _ in pieces:
            local.mul_(scale.to(local.device, local.dtype))
    return total


def _total_norm(pieces: list[Piece], norm_type: float, device: torch.device) -> Tensor:
    """The norm over every rank's pieces, each element counted once (see the module)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if math.isinf(norm_type):
        largest = max((float(p.abs().max()) for p, _ in pieces if p.numel()), default=0.0)
        reduced = torch.tensor(largest, dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return reduced.float()
    powered = torch.zeros((), dtype=torch.float64, device=device)
    for local, distinct in pieces:
        if local.numel():
            norm = torch.linalg.vector_norm(local.float(), norm_type).double()
            powered += norm.to(device) ** norm_type / _copies(world, distinct)
    if world > 1:
        dist.all_reduce(powered)
    return (powered ** (1.0 / norm_type)).float()


def _copies(world: int, distinct: int) -> int:
    copies, rest = divmod(world, distinct)
    if rest or not copies:
        raise ValueError(
            f"clip_grad_norm_: a parameter cut into {distinct} pieces over a world of {world} "
            "ranks: every rank must hold one piece of every parameter (SMP v2's layout)"
        )
    return copies


def _pieces(model: nn.Module) -> Iterator[Piece]:
    """Every gradient piece this rank holds: FSDP1's flat shards parameter by parameter, then
    the other parameters' gradients (DTensors by their local tensor)."""
    units = list(flat_units(model))
    for unit in units:
        yield from _flat_pieces(unit.flat, unit.shard_ranks)
    held = held_by_units(units)
    for param in model.parameters():  # each parameter once, however many names it has
        if id(param) not in held and param.grad is not None:
            grad = param.grad
            yield _dtensor_piece(grad) if isinstance(grad, DTensor) else (grad, 1)


def _flat_pieces(flat: FlatParameter, shard_ranks: int) -> Iterator[Piece]:
    """An FSDP1 flat parameter's gradient shard cut at its parameters' bounds: each part is
    one of ``shard_ranks`` shards of that parameter, and of its tensor-parallel slice if FSDP
    flattened a DTensor (its extension records the DTensor's placements)."""
    grad = flat.grad
    if grad is None:
        return
    for info, extension in zip(flat._shard_param_infos, flat._param_extensions, strict=True):
        start, count = info.offset_in_shard, info.numel_in_shard
        if info.in_shard and start is not None and count is not None:
            yield grad[start : start + count], shard_ranks * _sharded_extent(extension)


def _dtensor_piece(grad: DTensor) -> Piece:
    return grad._local_tensor, _sharded_extent(grad._spec)


def _sharded_extent(spec: DTensorSpec | None) -> int:
    """Into how many pieces a DTensor's placements ``spec`` cut it (1 for no DTensor): the
    sizes of its mesh dimensions that do not replicate it (``Shard``, and torch's strided
    shards of FSDP2 over tensor parallelism)."""
    if spec is None:
        return 1
    placements = spec.placements
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(
            "clip_grad_norm_: a gradient is a partial sum (DTensor placement Partial): reduce it "
            "before clipping"
        )
    mesh = spec.mesh
    return math.prod(mesh.size(dim) for dim, p in enumerate(placements) if not p.is_replicate())

"""FSDP1's flat parameters in a model, for code that reads what each rank holds without FSDP's
collectives (:mod:`dtrain.smpv2.grad_norm`, SMP's local state dicts).

FSDP1 keeps each unit's parameters flattened into one ``FlatParameter`` per unit and, on a
sharded strategy, each rank holds one slice of it; with ``use_orig_params=True`` the model's
``parameters()`` are views of that slice, otherwise the flat parameters themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp._flat_param import FlatParameter


@dataclass(frozen=True)
class FlatUnit:
    """One FSDP1 unit of a model: its path there (``named_modules``'s name), flat parameter,
    and the ranks its shards are spread over (1 where it does not shard)."""

    path: str
    flat: FlatParameter
    shard_ranks: int
    sharded: bool


def flat_units(model: nn.Module) -> Iterator[FlatUnit]:
    """The FSDP1 units of ``model`` that hold parameters, outermost first."""
    for path, module in model.named_modules():
        handle = getattr(module, "_handle", None) if isinstance(module, TorchFSDP) else None
        if handle is not None:
            sharded = bool(handle.uses_sharded_strategy)
            ranks = handle.process_group.size() if sharded else 1
            yield FlatUnit(path, handle.flat_param, ranks, sharded)


def held_by_units(units: list[FlatUnit]) -> set[int]:
    """The ids of the flat parameters of ``units`` and of the original parameters they hold."""
    held: set[int] = set()
    for unit in units:
        flat = unit.flat
        held.add(id(flat))
        originals = (flat._params or []) + (flat._shared_params or [])
        held.update(id(p) for p in originals)
    return held

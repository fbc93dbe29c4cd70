"""DeepSpeed's names for the shards, which AWS's sharded scripts read of SMP's sharded data
parallelism.

SMP v1 sharded on DeepSpeed's ZeRO-3 code, and AWS's scripts read its attributes: the
``sdp_utils.py`` that GPT-NeoX, BLOOM, Flan-T5, Falcon and GPT-J share (on the path without
the distributed transformer) lays each param group's shards end to end to find every
parameter's fp32 shard, and logs parameter norms from them; ``sharded_data_parallel_checkpoint``
stores whole shapes; the sharded scripts log the gradient norm. dtrain shards on FSDP2, whose
DTensor shards hold the same values, so the names are served with the meanings the scripts
give them:

* ``optimizer.fp16_groups``: the model's parameters by param group (their shapes are the whole
  ones: no ``ds_shape`` is needed);
* ``optimizer._global_grad_norm``: the last step's gradient norm (set by the engine);
* ``param.ds_tensor``: this rank's shard of the parameter, flat, a view that follows training,
  with ``ds_numel`` its number of elements (FSDP2's dim-0 piece, unpadded: on uneven shards
  the last ranks hold fewer, or none);
* ``optimizer.fp32_partitioned_groups_flat[i]``: param group ``i``'s shards end to end, as
  DeepSpeed's one flat fp32 tensor per group. FSDP2 keeps each shard in a tensor of its own,
  so only ``narrow(0, offset, size)`` within one parameter's extent is served (a view of that
  shard, which is what the scripts take); anything else fails, naming it;
* ``optimizer.ds_param_shard_group``: the process group the parameters are sharded over (the
  sharding mesh's shard dimension), over which the scripts sum squared shard norms.

DeepSpeed's ``ds_tensor`` holds the half partition with fp16/bf16 and the flat groups the fp32
masters; dtrain's shards are the fp32 masters (FSDP2 computes in half from them), so both name
them. The views follow the shards' memory, which FSDP2 keeps for the model's life (steps and
``load_state_dict`` write into it); converting the wrapped model (``model.to(dtype)``) would
give the parameters new memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.dtensors import local

FLAT_GROUPS = "optimizer.fp32_partitioned_groups_flat"


def flat_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``param``, flat, sharing its memory."""
    return local(param).detach().view(-1)


def mark_shards(params: Iterable[torch.Tensor]) -> None:
    """Give every parameter its ``ds_tensor``, as DeepSpeed's partitioned parameters have."""
    for param in params:
        shard = flat_shard(param)
        shard.ds_numel = shard.numel()  # type: ignore[attr-defined]  # DeepSpeed's name
        param.ds_tensor = shard  # type: ignore[attr-defined]  # DeepSpeed's name


class FlatGroup:
    """One param group's shards on this rank, end to end, as far as they can be a flat tensor
    here: a ``narrow`` along dim 0 within one parameter's extent."""

    def __init__(self, group: dict[str, Any], index: int) -> None:
        self._group = group
        self._index = index

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        offset, shard = 0, None
        for param in self._group["params"]:
            shard = flat_shard(param)
            end = offset + shard.numel()
            if dim == 0 and offset <= start and start + length <= end and (length or start < end):
                return shard.narrow(0, start - offset, length)
            offset = end
        if dim == 0 and start == offset and length == 0 and shard is not None:
            return shard.narrow(0, shard.numel(), 0)  # an empty shard at the group's end
        raise ModelParallelError(
            f"{FLAT_GROUPS}[{self._index}].narrow({dim}, {start}, {length}): dtrain's shards are "
            "FSDP2's, one tensor per parameter, so only a narrow along dim 0 within one "
            f"parameter's shard is served (the group's {offset} elements here, laid end to end "
            "by ds_tensor.ds_numel in param-group order)"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{FLAT_GROUPS}[{self._index}].{name}: dtrain's shards are FSDP2's, one tensor per "
            "parameter, not one flat tensor per group: of it only narrow(0, offset, size) "
            "within one parameter's shard is served (its ds_tensor views the same shard)"
        )


def expose(optimizer: torch.optim.Optimizer, shard_group: dist.ProcessGroup) -> None:
    """Give the script's optimizer DeepSpeed's names for the shards of its parameters."""
    names: Any = optimizer
    names.fp16_groups = [list(g["params"]) for g in optimizer.param_groups]
    names._global_grad_norm = 0.0
    names.fp32_partitioned_groups_flat = [
        FlatGroup(group, index) for index, group in enumerate(optimizer.param_groups)
    ]
    names.ds_param_shard_group = shard_group

"""``torch.sagemaker.distributed.checkpoint.state_dict_utils``: SMP's local state dicts.

``SMStateDictType.SM_LOCAL_STATE_DICT`` is each rank's own shards, taken without a collective
(FSDP's ``LOCAL_STATE_DICT`` gathers shard metadata across ranks): under
``sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT)``, ``model.state_dict()``
holds, for each FSDP1 unit, its flat parameter's local shard (``<unit path>.flat_param``), and
every other parameter and persistent buffer by name (a DTensor by its local tensor). The tensors
are the model's own, not copies, so loading a checkpoint into them in place (``load``, as SMP's
scripts do) restores the model. Such a checkpoint loads only where every rank holds the same
shards: the same hybrid shard and tensor parallel degrees (AWS: "the model shard degree needs
to be identical"), any number of replicas. Any of torch's ``StateDictType`` is FSDP's own
(``FSDP.state_dict_type``).

``init_optim_state`` gives an optimizer the state a step creates, so that a local checkpoint's
optimizer state loads into it in place.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.tensor import DTensor

from dtrain.smpv2.flat_params import flat_units, held_by_units


class SMStateDictType(enum.Enum):
    SM_LOCAL_STATE_DICT = enum.auto()


@contextlib.contextmanager
def sm_state_dict_type(
    module: nn.Module,
    state_dict_type: SMStateDictType | StateDictType,
    state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
) -> Iterator[None]:
    """Within it, ``module.state_dict()`` and ``module.load_state_dict()`` are of
    ``state_dict_type`` (see the module)."""
    if isinstance(state_dict_type, StateDictType):
        with TorchFSDP.state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        ):
            yield
        return
    if state_dict_type is not SMStateDictType.SM_LOCAL_STATE_DICT:
        raise ValueError(f"sm_state_dict_type: {state_dict_type!r} is not a state dict type")

    def state_dict(*args: Any, **kwargs: Any) -> dict[str, Tensor]:
        return local_state_dict(module)

    def load_state_dict(state: dict[str, Tensor], *args: Any, **kwargs: Any) -> None:
        load_local_state_dict(module, state)

    # The instance's own methods meanwhile, in place of nn.Module's (and their overloads).
    module.state_dict = state_dict  # type: ignore[method-assign,assignment]  # see above
    module.load_state_dict = load_state_dict  # type: ignore[method-assign,assignment]  # see above
    try:
        yield
    finally:
        del module.state_dict, module.load_state_dict


def local_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s own shards by name (see the module), without a collective."""
    units = list(flat_units(module))
    state: dict[str, Tensor] = {}
    for unit in units:
        shard = getattr(unit.flat, "_local_shard", None)  # set at FSDP's first forward
        if unit.sharded and shard is not None and unit.flat.data_ptr() != shard.data_ptr():
            raise RuntimeError(
                f"SM_LOCAL_STATE_DICT: FSDP unit {unit.path or '(root)'} holds its gathered "
                "parameters now (inside forward or backward); take the state dict between steps"
            )
        state[_joined(unit.path, "flat_param")] = unit.flat.detach()
    held = held_by_units(units)
    for name, param in module.named_parameters():
        if id(param) not in held:
            state[name] = _local(param)
    for path, owner in module.named_modules():
        for name, buffer in owner.named_buffers(prefix=path, recurse=False):
            if (
                buffer is not None
                and name.rpartition(".")[2] not in owner._non_persistent_buffers_set
            ):
                state[name] = _local(buffer)
    return state


def load_local_state_dict(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (as :func:`local_state_dict` gives it) into ``module``'s own shards."""
    own = local_state_dict(module)
    if own.keys() != state.keys():
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise KeyError(f"SM_LOCAL_STATE_DICT: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, tensor in own.items():
            if tensor.shape != state[name].shape:
                raise ValueError(
                    f"SM_LOCAL_STATE_DICT: {name} is {tuple(state[name].shape)} in the state "
                    f"dict, {tuple(tensor.shape)} here: saved at another shard degree"
                )
            tensor.copy_(state[name])


def _local(tensor: Tensor) -> Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def init_optim_state(optimizer: torch.optim.Optimizer, skip_empty_param: bool = False) -> None:
    """Create ``optimizer``'s per-parameter state by one step on zero gradients at learning
    rate 0 (parameters unchanged), as torch's distributed state dicts do; gradients are left
    as they were. ``skip_empty_param`` leaves parameters with no elements without state (FSDP's
    original parameters outside this rank's shard, which training never gives state)."""
    if optimizer.state:
        return
    zeroed = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                if skip_empty_param and param.numel() == 0:
                    continue
                param.grad = torch.zeros_like(param)
                zeroed.append(param)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        for param in zeroed:
            param.grad = None

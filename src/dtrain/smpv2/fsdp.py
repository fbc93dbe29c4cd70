"""torch's FSDP as SMP v2 scripts call it: sharding over the groups of ``tsm.state`` once
``tsm.init()`` ran, and taking SMP's ``post_param_init_fn``.

AWS's scripts wrap their model themselves with the names torch exports,
``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1) and ``fully_shard`` (FSDP2), and
rely on SMP's torch to shard over the degrees' groups. Importing ``torch.sagemaker`` puts
:class:`FullyShardedDataParallel` and :func:`fully_shard` under those names
(:mod:`dtrain.compat.torch_fsdp`); until ``tsm.init()`` they are torch's own, and so they stay
where the hybrid shard degree is 0 without tensor or context parallelism (SMP: the script's FSDP
as torch has it). Otherwise, where the script gives FSDP no groups:

* FSDP1 shards each parameter over its shard group and replicates it over the shard groups, on
  ``tsm.state.mesh("replicate", "hybrid_shard")``, with the strategy :mod:`dtrain.smpv2.sharding`
  decides (a hybrid one, as SMP sets; ``NO_SHARD`` for a hybrid shard degree of 1);
* FSDP2 gets that mesh as its ``mesh`` (hybrid sharding).

A script that gives groups (``process_group``, ``device_mesh``, ``mesh``) keeps them.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    FullyShardedDataParallel as TorchFSDP,
)
from torch.distributed.tensor import DTensor

from dtrain.smpv2.fsdp_state_dict import full_state_dict, place_on_layout
from dtrain.smpv2.post_init import ModuleFn, UnitInit
from dtrain.smpv2.runtime import is_initialized, state
from dtrain.smpv2.sharding import HYBRID, check_hybrid_groups, smp_sharding

_TORCH_ARGUMENTS = inspect.signature(TorchFSDP.__init__)


class _AnswersAsTorchFSDP(type):
    """``isinstance``/``issubclass`` against :class:`FullyShardedDataParallel` answer as against
    torch's class: the units torch's auto wrapping makes are torch's class, and a script asking
    ``isinstance(module, FSDP)`` of them means FSDP."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, TorchFSDP)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, TorchFSDP)


class FullyShardedDataParallel(TorchFSDP, metaclass=_AnswersAsTorchFSDP):
    """torch's ``FullyShardedDataParallel``, taking the same arguments and SMP's
    ``post_param_init_fn`` (called on each unit once ``param_init_fn`` has created it:
    :mod:`dtrain.smpv2.post_init`); once ``tsm.init()`` ran, sharding over its groups (see the
    module's docstring)."""

    def __init__(
        self,
        module: nn.Module,
        *args: Any,
        post_param_init_fn: ModuleFn | None = None,
        **kwargs: Any,
    ) -> None:
        arguments = _TORCH_ARGUMENTS.bind(self, module, *args, **kwargs)
        arguments.apply_defaults()
        given = dict(arguments.arguments)
        del given["self"]
        if post_param_init_fn is not None:
            given["param_init_fn"] = _with_post_init(given, post_param_init_fn)
        on_layout = is_initialized() and _shard_over_layout(given)
        super().__init__(**given)
        if on_layout:
            place_on_layout(self)

    def state_dict(  # type: ignore[override]  # nn.Module's overloads, passed on as they come
        self, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        """torch's; a ``FULL_STATE_DICT`` holds tensor-parallel parameters whole, in Hugging
        Face's format (:func:`dtrain.smpv2.fsdp_state_dict.full_state_dict`)."""
        if self._state_dict_type is not StateDictType.FULL_STATE_DICT:
            return super().state_dict(*args, **kwargs)
        return full_state_dict(self, functools.partial(super().state_dict, *args, **kwargs))


def _with_post_init(given: dict[str, Any], post_param_init_fn: ModuleFn) -> UnitInit:
    if given["param_init_fn"] is None:
        raise ValueError(
            "FullyShardedDataParallel: post_param_init_fn runs once param_init_fn has created a "
            "unit's parameters; give param_init_fn too (DelayedParamIniter.get_param_init_fn())"
        )
    if given["ignored_modules"] or given["ignored_states"]:
        raise ValueError(
            "FullyShardedDataParallel: post_param_init_fn with ignored_modules or ignored_states "
            "is not available in dtrain"
        )
    return UnitInit(given["param_init_fn"], post_param_init_fn)


def _shard_over_layout(given: dict[str, Any]) -> bool:
    """Set the strategy and mesh of SMP's layout in FSDP1's arguments ``given``, unless the
    script gave groups; fail where the groups would leave replicas training apart. Whether it
    set them."""
    strategy = given["sharding_strategy"]
    mesh, group = given["device_mesh"], given["process_group"]
    if mesh is not None:
        if strategy in HYBRID and mesh.ndim == 2:
            check_hybrid_groups(strategy, mesh.size(1), mesh.size(0))
        return False
    if group is not None:
        if strategy in HYBRID and isinstance(group, tuple):
            check_hybrid_groups(strategy, group[0].size(), group[1].size())
        return False
    if not state.hybrid_shard_degree:  # the script's FSDP as torch has it
        if strategy in HYBRID:
            # torch's FSDP1 shards a hybrid strategy without groups over each node's devices.
            devices = torch.cuda.device_count() if _on_cuda() else 1
            check_hybrid_groups(strategy, devices, state.world_size // devices)
        return False
    sharding = smp_sharding(strategy, state.hybrid_shard_degree, state.rep_size)
    if sharding.strategy is ShardingStrategy.NO_SHARD and given["use_orig_params"]:
        _check_no_dtensors(given["module"])
    if sharding.changed:
        warnings.warn(f"FullyShardedDataParallel: {sharding.changed}", stacklevel=3)
    given["sharding_strategy"] = sharding.strategy
    given["device_mesh"] = state.mesh(*sharding.mesh)
    return True


def _check_no_dtensors(module: nn.Module) -> None:
    """torch's FSDP1 cannot run NO_SHARD over tensor-parallel parameters with
    ``use_orig_params=True``: its first step fails ("Cannot writeback when the parameter shape
    changes"). Say so before training, naming the ways out."""
    if any(isinstance(param, DTensor) for param in module.parameters()):
        raise ValueError(
            "FullyShardedDataParallel: hybrid_shard_degree 1 runs as NO_SHARD, which torch's "
            "FSDP cannot run over tensor-parallel parameters with use_orig_params=True; set "
            "hybrid_shard_degree to 2 or more, use_orig_params=False, or use fully_shard (FSDP2)"
        )


def _on_cuda() -> bool:
    return state.mesh("replicate").device_type == "cuda"


@functools.wraps(torch_fully_shard)
def fully_shard(module: Any, **kwargs: Any) -> Any:
    """torch's FSDP2 ``fully_shard``; once ``tsm.init()`` ran with SMP's layout, a call without
    a mesh shards over ``tsm.state.mesh("replicate", "hybrid_shard")`` (hybrid sharding)."""
    unmeshed = kwargs.get("mesh") is None and kwargs.get("dp_mesh_dims") is None
    if unmeshed and is_initialized() and state.hybrid_shard_degree:
        kwargs["mesh"] = state.mesh("replicate", "hybrid_shard")
    return torch_fully_shard(module, **kwargs)


__all__ = ["FullyShardedDataParallel", "fully_shard"]

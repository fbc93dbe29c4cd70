"""SMP's ``post_param_init_fn``: a function FSDP calls on each unit once ``param_init_fn`` has
created the unit's parameters, before it flattens and shards them.

SMP ships a torch whose FSDP takes this argument; ``DelayedParamIniter.get_post_param_init_fn()``
gives one that re-ties tied weights (``module.tie_weights()``), which creating each module's
parameters on its own (``to_empty`` module by module) unties. Stock torch's FSDP has no such
argument, but it calls ``param_init_fn`` on a unit's modules in one loop, the unit's root module
first (a breadth-first walk that stops at modules FSDP already wraps). :class:`UnitInit` stands
in for ``param_init_fn``: its first call on a unit, with the unit's root, creates the whole unit
in that same order and then calls ``post_param_init_fn`` on the root; torch's further calls on
the unit's other modules find them created and do nothing.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    FullyShardedDataParallel as TorchFSDP,
)

ModuleFn = Callable[[nn.Module], None]


def unit_modules(root: nn.Module) -> list[nn.Module]:
    """The modules FSDP creates with ``root``'s unit, in the order torch calls ``param_init_fn``
    on them: breadth first from ``root``, not entering modules FSDP wraps already."""
    found = [root]
    queue = collections.deque([root])
    seen = {id(root)}
    while queue:
        for child in queue.popleft().children():
            if id(child) not in seen and not isinstance(child, TorchFSDP):
                seen.add(id(child))
                found.append(child)
                queue.append(child)
    return found


class UnitInit:
    """``param_init_fn`` that also calls ``post_param_init_fn`` on each unit's root module once
    the unit's modules are created (see the module's docstring)."""

    def __init__(self, param_init_fn: ModuleFn, post_param_init_fn: ModuleFn) -> None:
        self._init = param_init_fn
        self._post = post_param_init_fn
        self._created: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __call__(self, module: nn.Module) -> None:
        if module in self._created:
            return
        unit = unit_modules(module)
        for member in unit:
            self._init(member)
        self._post(module)
        self._created.update(unit)

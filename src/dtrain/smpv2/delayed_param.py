"""``torch.sagemaker.delayed_param.DelayedParamIniter``: a model created on the meta device is
made by FSDP's ``param_init_fn`` once sharded, module by module, with eager creation's values.

AWS's scripts create the model on the meta device, transform it, make an initer and pass its
``get_param_init_fn()`` and ``get_post_param_init_fn()`` to FSDP inside
``validate_params_and_buffers_inited()``. FSDP calls the first on every module that holds
tensors without memory: each of the module's own tensors becomes its eager value
(:mod:`.eager`), cut to this rank's part where it is a DTensor (split over the tp mesh, or
sharded by FSDP2 too), in place: the same Python objects, so tied parameters stay tied. The
second calls a module's ``tie_weights`` (HF's), as SMP's does. FSDP2 has neither hook: call the
first on each module after ``fully_shard`` (see :meth:`DelayedParamIniter.get_param_init_fn`).

A script's own ``init_method_using_config(module)`` replaces the replay (for a model that is not
a Hugging Face one); the initer then only counts what it made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dtrain.modelparallel.deferred import swap_in
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.dtensors import cut
from dtrain.smpv2.eager import EagerCreation

WHAT = "torch.sagemaker.delayed_param.DelayedParamIniter"

ModuleFn = Callable[[nn.Module], None]


class DelayedParamIniter:
    """Makes the tensors of ``model`` (created on the meta device, maybe transformed) that have
    no memory, module by module (see the module)."""

    def __init__(
        self,
        model: nn.Module,
        init_method_using_config: ModuleFn | None = None,
        verbose: bool = False,
    ) -> None:
        self.model = model
        self.verbose = verbose
        self._custom = init_method_using_config
        self._prefixes = {
            id(module): f"{name}." if name else ""
            for name, module in model.named_modules(remove_duplicate=False)
        }
        self._pending: dict[str, int] = {
            name: id(param)
            for name, param in model.named_parameters(remove_duplicate=False)
            if param.is_meta
        }
        """The parameters to make, by name: the id of the parameter each name held."""
        self._made: set[str] = set()
        self._device = _device(model)
        self._eager = None
        meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        if init_method_using_config is None and meta:
            self._eager = EagerCreation(model, WHAT)

    def get_param_init_fn(self) -> ModuleFn:
        """``param_init_fn`` for FSDP: make ``module``'s own tensors that have no memory (its
        children's are theirs). With FSDP2, call it on every module after ``fully_shard``:
        ``for module in model.modules(): init(module)``."""
        return self._init if self._custom is None else self._init_custom

    def get_post_param_init_fn(self) -> ModuleFn:
        """``post_param_init_fn`` for SMP's FSDP: tie ``module``'s weights again where it has
        HF's ``tie_weights`` (an initialisation that replaced tied parameters untied them)."""
        return _tie_weights

    def count_num_params(self, module: nn.Module, *params: Tensor) -> None:
        """Count ``params``, parameters of ``module`` itself, as made (with every other name
        of the same parameter)."""
        prefix = self._prefix(module)
        chosen = {id(param) for param in params}
        for name, param in module.named_parameters(recurse=False):
            if id(param) in chosen:
                owner = self._pending.get(prefix + name)
                self._made.update(n for n, i in self._pending.items() if i == owner)
                self._made.add(prefix + name)

    @contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True) -> Iterator[None]:
        """Around FSDP's construction: afterwards every parameter that had no memory was made
        by this initer, and no parameter or buffer of the model is left on the meta device
        (``AssertionError`` naming them otherwise)."""
        yield
        if not enabled:
            return
        missing = sorted(set(self._pending) - self._made)
        left = [
            name
            for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]
            if tensor.is_meta
        ]
        if missing or left:
            raise AssertionError(
                f"{WHAT}: {len(self._pending) - len(missing)} of {len(self._pending)} parameters "
                f"made by its param_init_fn; not made: {_few(missing)}; still on the meta "
                f"device: {_few(left)}"
            )

    # --- making ------------------------------------------------------------------------------

    def _prefix(self, module: nn.Module) -> str:
        prefix = self._prefixes.get(id(module))
        if prefix is None:
            raise ModelParallelError(
                f"{WHAT}: a {type(module).__name__} that is not a module of the model it was "
                "made for"
            )
        return prefix

    def _init(self, module: nn.Module) -> None:
        prefix = self._prefix(module)
        made = []
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if self._eager is None:
                    raise ModelParallelError(
                        f"{WHAT}: {prefix + name} is on the meta device, but no tensor of the "
                        "model was when the initer was made; make it once the model is created"
                    )
                value = self._eager.value(prefix + name, self._device)
                swap_in(tensor, _laid_out(tensor, value))
                made.append(tensor)
        self.count_num_params(module, *made)
        if self.verbose and made:
            logging.getLogger("torch.sagemaker").info(
                "%s: made %d tensors of %s", WHAT, len(made), prefix[:-1] or "the model"
            )

    def _init_custom(self, module: nn.Module) -> None:
        assert self._custom is not None
        self._custom(module)
        made = [p for p in module.parameters(recurse=False) if not p.is_meta]
        self.count_num_params(module, *made)


def _laid_out(like: Tensor, value: Tensor) -> Tensor:
    """The whole ``value`` of ``like`` laid out as it: this rank's part of a DTensor, a
    contiguous copy (FSDP2 views it flat; a view would hold the whole value)."""
    if not isinstance(like, DTensor):
        return value
    part = cut(WHAT, like, value).clone(memory_format=torch.contiguous_format)
    return DTensor.from_local(
        part, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def _device(model: nn.Module) -> torch.device:
    """Where the model computes: its tp mesh's device, else the rank's GPU unless the world
    runs on gloo, else the CPU."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            return _on(param.device_mesh.device_type)
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    return _on("cuda" if torch.cuda.is_available() and not gloo else "cpu")


def _on(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _tie_weights(module: nn.Module) -> None:
    tie = getattr(module, "tie_weights", None)
    if callable(tie):
        tie()


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more

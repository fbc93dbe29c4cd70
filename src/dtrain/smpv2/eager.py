"""The values eager creation gives a Hugging Face model created on the meta device.

The model's class is built again from its config under SMP v1's delayed creation
(:func:`dtrain.modelparallel.deferred.delay_param_initialization`): without memory, every
operation of the creation recorded, and every random one run once on a scratch tensor, so the
generator advances exactly as eager creation advances it. A tensor's value is then replayed
alone, from the generator states its initialisers drew from, on the device asked for: the values
eager creation would have given it, on a rank that never holds the whole model.

So a script that seeds, creates its model on the meta device (``accelerate.init_empty_weights``,
``torch.device("meta")``: neither draws random numbers) and makes a
:class:`~dtrain.smpv2.delayed_param.DelayedParamIniter` before drawing anything else gets the
parameters, and afterwards the random stream, of one that seeds and creates it eagerly. Ranks
seeded alike create one model, as they do eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from dtrain.modelparallel.deferred import delay_param_initialization, recordings_of
from dtrain.modelparallel.errors import ModelParallelError


class EagerCreation:
    """``model``'s class created again from ``model.config``, its tensors' eager values
    replayable by name (``what`` names the caller in errors)."""

    def __init__(self, model: nn.Module, what: str) -> None:
        kind = type(model)
        config = getattr(model, "config", None)
        if config is None or not hasattr(kind, "config_class"):
            raise ModelParallelError(
                f"{what}: {kind.__qualname__} is not a Hugging Face model, whose creation it "
                "replays from its config; pass init_method_using_config, a function "
                "initialising one module's own parameters"
            )
        self.what = what
        try:
            with _default_dtype(_dtype_of(model)), delay_param_initialization():
                twin = kind(config)
        except ModelParallelError as exc:
            raise ModelParallelError(
                f"{what}: {kind.__qualname__}'s creation cannot be replayed ({exc}); pass "
                "init_method_using_config"
            ) from exc
        self.tensors = {
            **dict(twin.named_parameters(remove_duplicate=False)),
            **dict(twin.named_buffers(remove_duplicate=False)),
        }
        (self.recording,) = recordings_of(self.tensors.values())

    def value(self, name: str, device: torch.device) -> Tensor:
        """The whole eager value of the model's parameter or buffer ``name``, on ``device``."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelParallelError(
                f"{self.what}: {name!r} is not a tensor of the model its class creates from its "
                "config (a module added or renamed after creation); pass "
                "init_method_using_config"
            )
        (value,) = self.recording.replay([tensor])
        return value.to(device)


def _dtype_of(model: nn.Module) -> torch.dtype:
    """The dtype ``model``'s floating parameters were created in (the default's if mixed)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.get_default_dtype()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

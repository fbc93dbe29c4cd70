"""What every ``smp.nn`` module shares: checks of its arguments against the tp degree and what
dtrain implements, its seeded initialization and its whole-tensor state dicts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import generators
from dtrain.modelparallel.tensor import shards

TUNING_ARGUMENTS = frozenset(
    {
        "fused_softmax",
        "fused_bias_gelu",
        "fused_dropout",
        "flash_attention",
        "attention_in_fp32",
        "query_key_layer_scaling",
        "zero_init",
    }
)
"""SMP's kernel and fp16 switches (``smp.tensor_parallelism(fused_softmax=...)``), accepted by
every distributed module. ``attention_in_fp32`` and ``query_key_layer_scaling`` take effect in
:class:`.attention.DistributedAttentionLayer` in half precision (its own arguments); a model
split in place computes its attention as Hugging Face wrote it (in half precision a warning
says they change nothing there: :mod:`.huggingface.inplace`). The others are without effect:
they choose fused kernels, which dtrain's ``scaled_dot_product_attention`` does not offer as
switches; and ``zero_init``, SMP's creation of sharded-data-parallel models in shards, which
dtrain's delayed initialisation does without being asked (``zero_init=False`` on a GPT-NeoX or
GPT-J model also asks for its translation, :func:`.swap._translates`)."""

UNSUPPORTED_EXTRAS: dict[str, Any] = {
    "fp32_residual_addition": False,
    "use_alibi": False,
    "alibi_bias_max": 8,
    "_scale_qkv_fan_out": False,
}
"""SMP's further transformer arguments, implemented only at these (their default) values."""

_created = itertools.count()
"""Numbers the distributed modules this process creates; every rank creates them in one order."""


def _forget_creations() -> None:
    global _created
    _created = itertools.count()


state.on_reset(_forget_creations)


def whole_state_dicts(module: nn.Module) -> None:
    """``module.state_dict()`` gives whole tensors and ``load_state_dict`` takes them (a plain
    module's), whatever the tp degree."""
    module._register_state_dict_hook(shards.whole_state_dict_hook)
    module.register_load_state_dict_pre_hook(shards.shard_load_hook)


class DistributedModule(nn.Module):
    """Base of the ``smp.nn`` modules built of several layers."""

    def __init__(self) -> None:
        super().__init__()
        whole_state_dicts(self)

    @property
    def what(self) -> str:
        """How errors name this module."""
        return f"smp.nn.{type(self).__name__}"


def split(what: str, name: str, value: int) -> int:
    """``value`` (the size ``name`` of module ``what``) over the tp degree (:func:`split_over`)."""
    return split_over(what, name, value, state.current(what).tp_size)


def split_over(what: str, name: str, value: int, degree: int) -> int:
    """``value`` (the size ``name`` of module ``what``) over tp ``degree``; it must divide
    evenly, since every rank holds an equal shard."""
    if value % degree:
        raise ModelParallelError(
            f"{what}: {name}={value} does not split over tensor_parallel_degree={degree}; "
            f"allowed: a multiple of {degree}"
        )
    return value // degree


def refuse_unsupported(what: str, values: Mapping[str, Any], supported: Mapping[str, Any]) -> None:
    """Arguments of SMP's that dtrain implements only at the value in ``supported``, and
    unknown ones: each named, with what is allowed."""
    for name, value in values.items():
        if name in TUNING_ARGUMENTS:
            continue
        if name not in supported:
            raise TypeError(f"{what}: unexpected argument {name!r}")
        if value != supported[name]:
            raise ModelParallelError(
                f"{what}: {name}={value!r} is not supported by dtrain; allowed: {supported[name]!r}"
            )


def check_speed_layout(what: str) -> None:
    """SMP's ``optimize: memory`` also splits layer norms and activations over the tp group;
    dtrain lays transformers out as ``speed`` only, and says so rather than run another way."""
    st = state.current(what)
    if st.tp_size > 1 and st.config["optimize"] != "speed":
        raise ModelParallelError(
            f"{what}: optimize={st.config['optimize']!r} is not supported with tensor "
            "parallelism by dtrain; allowed: 'speed'"
        )


@contextmanager
def seeded(what: str) -> Iterator[None]:
    """Create a distributed module's parameters from ``tensor_parallel_seed`` and the module's
    creation number: the same values on every rank and at every tp degree, so a module split
    over two ranks starts as its single-process equivalent does. The CPU generator and the
    rank's GPU's (where a module created on it draws) are forked, no other: the rank's own
    streams go on as they were, so data-parallel replicas seeded apart still draw their own
    dropout masks."""
    st = state.current(what)
    devices = [st.device] if st.device.type == "cuda" else []
    with generators.forked(st.config["tensor_parallel_seed"] + (next(_created) << 32), devices):
        yield


def init_linear(layer: nn.Linear, normal: bool, initializer_range: float) -> None:
    """SMP's initializations: normal with ``initializer_range`` and zero bias, or torch's."""
    if normal:
        nn.init.normal_(layer.weight, std=initializer_range)
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)
    else:
        layer.reset_parameters()

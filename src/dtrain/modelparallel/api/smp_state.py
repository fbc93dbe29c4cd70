"""SMP's state object (``smp.state``, ``smdistributed.modelparallel.torch.state_mod.state``), as
scripts read it.

SMP keeps its runtime on one object; scripts and Hugging Face's ``Trainer`` read a few of its
attributes, which are served here from dtrain's runtime (:mod:`dtrain.modelparallel.state`):

* ``cfg``: the running parameters, one attribute each under its schema name, as SMP's
  ``ModelParallelConfig`` (``Trainer`` reads ``.fp16``, ``.prescaled_batch`` and
  ``.shard_optimizer_state``; AWS's ``smp_trainer.py`` ``.sharded_data_parallel_degree``);
* ``module_manager.translate_functions``: ``(to_hf, from_hf)`` renaming a full state dict of
  the model between SMP's names and Hugging Face's (``save_pretrained`` under SMP applies the
  first of each pair): one pair once a ``DistributedModel`` exists (it renames the modules
  translated from Hugging Face, ``DistributedTransformerLMHead``, and leaves the rest).

Any other attribute is SMP's internal state, which dtrain does not keep: reading one fails,
naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from dtrain.config.modelparallel import SMP_INTERNAL_PARAMETERS
from dtrain.errors import did_you_mean
from dtrain.modelparallel import state
from dtrain.modelparallel.tensor import translated

StateDict = dict[str, Any]

NOT_KEPT: dict[str, str] = {
    "param_name_to_index_tp_group": (
        "SMP's optimizer's index of each parameter by name, per tp rank (AWS's older fp16 "
        "package, fp16/fp16.py, reads it to load its own masters, and also needs apex); "
        "smp.DistributedOptimizer keeps fp16/bf16 masters itself: drop the package and pass "
        "fp16 or bf16 to smp.init"
    ),
}
NOT_KEPT["param_index_to_name_tp_group"] = NOT_KEPT["param_name_to_index_tp_group"]


class ModelParallelConfig:
    """The running parameters by name, read-only; a name that is no parameter fails, naming it
    and what there is."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        values: dict[str, Any] = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name.startswith("__"):
            raise AttributeError(name)
        if name in SMP_INTERNAL_PARAMETERS:
            raise AttributeError(
                f"smp.state.cfg.{name}: one of SMP's internal parameters, which dtrain accepts "
                "and ignores: it holds no value for it"
            )
        near = did_you_mean(name, values)
        hint = f" (did you mean {near!r}?)" if near else ""
        raise AttributeError(
            f"smp.state.cfg.{name}: no such parameter{hint}; the parameters are {', '.join(values)}"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"smp.state.cfg.{name}: read-only; the parameters are set by smp.init(config) and "
            "the job's mp_parameters"
        )

    def __dir__(self) -> list[str]:
        return list(object.__getattribute__(self, "_values"))

    def __repr__(self) -> str:
        return f"ModelParallelConfig({object.__getattribute__(self, '_values')!r})"


class ModuleManager:
    """What is read of SMP's module manager: the model's state-dict translations."""

    @property
    def translate_functions(
        self,
    ) -> list[tuple[Callable[[StateDict], StateDict], Callable[[StateDict], StateDict]]]:
        model = state.current_model()
        if model is None:
            return []
        root = model.get_module()
        to_hf = functools.partial(translated.to_hf, root)
        return [(to_hf, functools.partial(translated.from_hf, root))]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"smp.state.module_manager.{name}: SMP's module registry, which dtrain does not keep; "
            "of it, dtrain serves translate_functions"
        )


class SMPState:
    """``smp.state``: ``cfg`` and ``module_manager`` served, anything else refused by name."""

    module_manager = ModuleManager()

    @property
    def cfg(self) -> ModelParallelConfig:
        return ModelParallelConfig(state.current("smp.state.cfg").config)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        why = NOT_KEPT.get(name, "SMP's internal state, which dtrain does not keep")
        raise AttributeError(
            f"smp.state.{name}: {why}; of SMP's state object dtrain serves cfg (the running "
            "parameters) and module_manager.translate_functions"
        )


smp_state = SMPState()

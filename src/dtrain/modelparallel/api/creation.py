"""``smp.model_creation``: SMP's one context for creating a model (dtype, delayed init, TP)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dtrain.modelparallel import state
from dtrain.modelparallel.deferred import delay_param_initialization
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.marks import tensor_parallelism as marking


@contextmanager
def model_creation(
    tensor_parallelism: bool = False,
    dtype: torch.dtype | None = None,
    **tensor_parallel_config: Any,
) -> Iterator[None]:
    """Create the model inside: as ``dtype`` (the default dtype while inside) and, when the
    job's ``delayed_parameter_initialization`` is true, without memory (see
    :func:`~dtrain.modelparallel.deferred.delay_param_initialization`), and with
    ``tensor_parallelism`` marked for distribution as ``smp.tensor_parallelism(**config)``
    marks them."""
    delayed = bool(state.current("smp.model_creation").config["delayed_parameter_initialization"])
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ModelParallelError(
            f"smp.model_creation: dtype is {dtype!r}; allowed: a floating torch.dtype "
            "(torch.float32, torch.bfloat16, torch.float16) or None"
        )
    previous = torch.get_default_dtype()
    with marking(tensor_parallelism, **tensor_parallel_config):
        torch.set_default_dtype(dtype or previous)
        try:
            with delay_param_initialization(delayed):
                yield
        finally:
            torch.set_default_dtype(previous)

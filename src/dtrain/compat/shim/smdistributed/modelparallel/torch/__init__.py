"""``import smdistributed.modelparallel.torch as smp``: see ``dtrain.modelparallel``.

As SMP does, importing this inside a model-parallel job (``SM_HP_MP_PARAMETERS`` and
``OMPI_COMM_WORLD_RANK`` set, as ``dtrain run`` does) initializes the library, unless
``SMP_MANUAL_INIT`` is set to a non-zero value. Unlike SMP, the start waits for the first call
that needs it, so that the script's own ``smp.init(config)`` is merged with the job's parameters
instead of being ignored.
"""

import importlib
import importlib.util
import os
from typing import Any

from dtrain import modelparallel
from dtrain.modelparallel import *  # noqa: F403  (the module is the API)
from dtrain.modelparallel.api.smp_state import smp_state as state  # noqa: F401  (smp.state)

__all__ = modelparallel.__all__


def __getattr__(name: str) -> Any:
    """What ``dtrain.modelparallel`` imports on first use (``smp.nn``), else SMP's modules that
    only this package has (``smp.model``, ``smp.utils``)."""
    try:
        return getattr(modelparallel, name)
    except AttributeError:
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise
        return importlib.import_module(f"{__name__}.{name}")


def _auto_init() -> bool:
    in_job = "SM_HP_MP_PARAMETERS" in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ
    return in_job and os.environ.get("SMP_MANUAL_INIT", "0").strip() in ("", "0")


if _auto_init():
    modelparallel.state.request_auto_init()

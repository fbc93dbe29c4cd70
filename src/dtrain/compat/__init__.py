"""Run scripts written for SageMaker's ``smdistributed`` libraries unmodified.

Workers of a dtrain job get :data:`SHIM_ROOT` on their ``PYTHONPATH``: it holds a top-level
``smdistributed`` package whose modules re-export dtrain's implementations under SageMaker's
import paths. A real ``smdistributed`` installation is never shadowed: the shim is added only when
none can be imported, and then last on the path.

SMP v2's ``torch.sagemaker`` cannot be served that way, since ``torch`` is a real package: its
modules are :mod:`dtrain.compat.torch_sagemaker`, which :mod:`dtrain.compat.graft` makes
importable as ``torch.sagemaker`` without touching the installed torch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SHIM_ROOT = Path(__file__).resolve().parent / "shim"


def real_smdistributed_installed() -> bool:
    """Whether this interpreter can import an ``smdistributed`` that is not our shim."""
    spec = importlib.util.find_spec("smdistributed")
    if spec is None or spec.origin is None:
        return False
    return SHIM_ROOT not in Path(spec.origin).resolve().parents


def shim_pythonpath_entry() -> str | None:
    """The ``PYTHONPATH`` entry workers need for ``import smdistributed...``, if any."""
    return None if real_smdistributed_installed() else str(SHIM_ROOT)


def add_shim_to_path() -> None:
    """Let this process ``import smdistributed...`` as a job's workers can (last on the path,
    only without a real installation), where nothing put the shim on ``PYTHONPATH``."""
    entry = shim_pythonpath_entry()
    if entry is not None and entry not in sys.path:
        sys.path.append(entry)

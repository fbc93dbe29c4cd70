"""Run scripts written for SageMaker's ``smdistributed`` libraries unmodified.

Workers of a dtrain job get :data:`SHIM_ROOT` on their ``PYTHONPATH``: it holds a top-level
``smdistributed`` package whose modules re-export dtrain's implementations under SageMaker's
import paths. A real ``smdistributed`` installation is never shadowed: the shim is added only when
none can be imported, and then last on the path.
"""

from __future__ import annotations

import importlib.util
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

"""dtrain's own settings of the model-parallel runtime (SMP has no parameter for them).

They come from the environment (so a job sets them with ``--environment``), are read once by
``smp.init`` and checked there: a value that is not understood fails naming the variable,
before any rank waits for another.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import ConfigError

TIMEOUT_ENV = "DTRAIN_MP_TIMEOUT"
STALL_ENV = "DTRAIN_MP_STALL_REPORT"
TRACE_ENV = "DTRAIN_MP_TRACE"


@dataclass(frozen=True)
class RuntimeOptions:
    timeout: float = 300.0
    """Seconds any wait for another rank may take before it fails naming that rank."""
    stall_report: float = 60.0
    """Seconds of silence after which every rank reports what it waits for (see
    :mod:`.pipeline.stall`); the wait itself goes on until ``timeout``."""
    trace: str = ""
    """Where the first pipeline's leader writes the Chrome trace of the last step, after every
    step (``""``: nowhere); a relative path is taken in the job's output data folder
    (``SM_OUTPUT_DATA_DIR``), so that it comes back with the job's output."""

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> RuntimeOptions:
        defaults = cls()
        return cls(
            timeout=_seconds(environ, TIMEOUT_ENV, defaults.timeout),
            stall_report=_seconds(environ, STALL_ENV, defaults.stall_report),
            trace=_trace_path(environ),
        )


def _trace_path(environ: Mapping[str, str]) -> str:
    """``DTRAIN_MP_TRACE`` as an absolute path in an existing folder (or ``""``)."""
    raw = environ.get(TRACE_ENV, "").strip()
    if not raw:
        return ""
    path = Path(environ.get("SM_OUTPUT_DATA_DIR") or ".", raw).absolute()
    if not path.parent.is_dir() or path.is_dir():
        raise ConfigError(
            TRACE_ENV,
            raw,
            f"a file in an existing folder ({path} is a folder, or its folder does not exist)",
        )
    return str(path)


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(name, raw, "a positive number of seconds")
    return value

"""The ranks' key of a job attempt: derived by each host's agent, handed to its ranks in
``DTRAIN_JOB_KEY``, and taken out of a rank's environment at once, so that no process the
script starts inherits it. Without torch: agents and the rank runner use it too."""

from __future__ import annotations

import hashlib
import hmac
import os
import threading

from dtrain.errors import DtrainError

KEY_ENV = "DTRAIN_JOB_KEY"

_taken: bytes | None = None
_lock = threading.Lock()


def derive_key(secret: bytes, job_name: str, salt: str, attempt: int) -> str:
    """The ranks' key of one attempt of a job, from the job's secret (hex): jobs sharing a
    secret file still get keys of their own."""
    context = f"dtrain ranks' key\0{job_name}\0{salt}\0{attempt}"
    return hmac.new(secret, context.encode(), hashlib.sha256).hexdigest()


def take_key() -> bytes | None:
    """``DTRAIN_JOB_KEY``, taken out of the environment the first time and kept for this
    process's later calls; None where the launcher gave none."""
    global _taken
    with _lock:
        value = os.environ.pop(KEY_ENV, None)
        if value:
            try:
                _taken = bytes.fromhex(value)
            except ValueError:
                raise DtrainError(f"{KEY_ENV} is not a key in hexadecimal") from None
        return _taken

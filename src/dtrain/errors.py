"""Errors users see: each names what was wrong and what is allowed.

They print without a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable
from typing import Any


class DtrainError(Exception):
    """Base class for errors the CLI reports as a one-line message instead of a traceback."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """Closest candidate to a misspelled ``word``.

    E.g. ``process_per_host`` -> ``processes_per_host``.
    """
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


class ConfigError(DtrainError):
    """A configuration value is invalid.

    The message names the key, the value and what is allowed.
    """

    def __init__(self, key: str, value: Any, allowed: str, suggestion: str | None = None) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        self.suggestion = suggestion
        super().__init__(self._format())

    def _format(self) -> str:
        message = f"{self.key}: got {self.value!r}; allowed: {self.allowed}"
        if self.suggestion:
            message += f" (did you mean {self.suggestion!r}?)"
        return message


def check_choice(key: str, value: str, allowed: Collection[str]) -> None:
    """``value`` is one of ``allowed``, or a :class:`ConfigError` listing them (and a near miss)."""
    if value not in allowed:
        raise ConfigError(key, value, ", ".join(allowed), did_you_mean(value, allowed))


class UnknownKeyError(ConfigError):
    """A key that is not part of the schema, usually a misspelling."""

    def __init__(self, where: str, key: str, known: Iterable[str]) -> None:
        known = sorted(known)
        super().__init__(
            f"{where}.{key}" if where else key, key, ", ".join(known), did_you_mean(key, known)
        )

    def _format(self) -> str:
        hint = f" (did you mean {self.suggestion!r}?)" if self.suggestion else ""
        return f"{self.key}: unknown key{hint}; allowed keys: {self.allowed}"


class JobFailedError(DtrainError):
    """A job ended Failed or Stopped while the caller waited for it.

    SageMaker's UnexpectedStatusException.
    """

    def __init__(self, job_name: str, status: str, reason: str | None) -> None:
        self.job_name = job_name
        self.status = status
        self.reason = reason
        super().__init__(f"job {job_name} ended {status}: {reason or 'no reason recorded'}")

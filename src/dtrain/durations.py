"""Durations as people type them (``7d``, ``12h``, ``1d12h``, ``90m``): ``dtrain prune
--older-than`` and ``dtrain run --max-run`` read them with the same parser."""

from __future__ import annotations

import re

from dtrain.errors import ConfigError

_UNITS = {"s": 1, "m": 60, "h": 60 * 60, "d": 24 * 60 * 60, "w": 7 * 24 * 60 * 60}
_NUMBER = r"\d+(?:\.\d+)?"
_DURATION = re.compile(rf"(?:{_NUMBER}[smhdw])+")
_PART = re.compile(rf"({_NUMBER})([smhdw])")


def parse_duration(flag: str, text: str, *, bare_seconds: bool = False) -> float:
    """``7d``, ``12h``, ``1d12h``, ``90m``, ``30s``, ``2w`` in seconds; with ``bare_seconds``, a
    number without a unit too (``3600``: what ``--max-run`` took before it took units).

    Without it a bare number is refused: ``--older-than 7`` meant as days would delete every
    job that ended more than 7 seconds ago."""
    if bare_seconds and re.fullmatch(_NUMBER, text):
        return float(text)
    if not _DURATION.fullmatch(text):
        seconds = " or a number of seconds" if bare_seconds else ""
        raise ConfigError(
            flag, text, f"a duration such as 7d, 12h, 1d12h, 30m or 45s (units s m h d w){seconds}"
        )
    return sum(float(count) * _UNITS[unit] for count, unit in _PART.findall(text))

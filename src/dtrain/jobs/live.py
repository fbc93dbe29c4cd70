"""How a job is getting on, in one line: elapsed time, the latest metric and its step rate.

``dtrain jobs`` shows it for every job, and ``dtrain run`` prints it now and then on a terminal.
A metric's step is its sample count (:class:`~dtrain.jobs.metrics.MetricSample`), so its samples
per second are the script's logging steps per second: the rate a person watches for a stall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dtrain.jobs.metrics import MetricSample

RATE_WINDOW = 20
"""Samples the step rate is measured over: recent enough to show a slowdown, enough to smooth
one slow step."""


@dataclass(frozen=True)
class Latest:
    """The last sample of a job's busiest metric, with its recent step rate (steps per second)."""

    sample: MetricSample
    rate: float | None

    def __str__(self) -> str:
        text = f"{self.sample.name}={self.sample.value:.4g}"
        return text if self.rate is None else f"{text} ({format_rate(self.rate)})"


def step_rate(samples: Sequence[MetricSample], window: int = RATE_WINDOW) -> float | None:
    """Steps per second of one metric over its last ``window`` samples (in step order).

    ``None`` with fewer than two samples, or none of them apart in time (one burst of lines):
    no rate can be told from them.
    """
    recent = sorted(samples, key=lambda sample: sample.step)[-window:]
    if len(recent) < 2:
        return None
    seconds = recent[-1].timestamp - recent[0].timestamp
    if seconds <= 0:
        return None
    return (recent[-1].step - recent[0].step) / seconds


def latest(samples: Sequence[MetricSample]) -> Latest | None:
    """The last sample of the metric logged most often, and its step rate; ``None`` without
    samples.

    The busiest metric counts the script's steps (a loss each step, not an accuracy each epoch).
    A sample's step is its metric's count so far, so the last samples of each metric are enough
    to find it (``dtrain run`` keeps only those).
    """
    if not samples:
        return None
    last = max(samples, key=lambda sample: (sample.step, sample.name))
    return Latest(last, step_rate([s for s in samples if s.name == last.name]))


def format_rate(rate: float) -> str:
    """``2.5 steps/s``, ``0.0333 steps/s``, ``1250 steps/s``: three significant digits (every
    digit of a rate over 100), in the one unit ``dtrain jobs``, ``dtrain run``'s status lines
    and ``dtrain ui`` all show."""
    return f"{rate:.0f} steps/s" if rate >= 100 else f"{rate:.3g} steps/s"


def format_elapsed(seconds: float) -> str:
    """``42s``, ``3m05s`` or ``2h03m05s``."""
    whole = int(max(seconds, 0))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"

"""Progress shown to a person: bars for copies and uploads, a status line for a running job.

Shown only where a person watches, a terminal: when the stream is a file or a pipe (tests, CI,
``| tee``, an agent's log) nothing is written, so captured output and logs stay as they were.
Every bar of dtrain comes from :func:`byte_bar`, one look for all of them; lines repeated while a
job runs come from a :class:`Ticker`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import IO

from tqdm import tqdm


def is_terminal(stream: IO[str] | None) -> bool:
    """Whether ``stream`` is a terminal; a closed stream or one without ``isatty`` is not."""
    isatty = getattr(stream, "isatty", None)
    if isatty is None:
        return False
    try:
        return bool(isatty())
    except ValueError:  # closed
        return False


def byte_bar(description: str, total: int | None, stream: IO[str] | None) -> tqdm:
    """A bar counting bytes (``12.3M/40.0M [00:02, 6.1MB/s]``) on ``stream``, disabled, writing
    nothing, unless that stream is a terminal (``None``: nowhere, as for ``dtrain run --quiet``).

    ``total`` may be unknown (a stream packed as it arrives, S3 objects not asked their size): the
    bar then shows the bytes so far and their rate.
    """
    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=stream,
        disable=not is_terminal(stream),
        leave=True,
        dynamic_ncols=True,
        mininterval=0.5,
    )


class Ticker:
    """Calls ``tick`` every ``interval`` seconds on a thread of its own from ``start`` to
    ``stop`` (or in its ``with`` block), if ``stream`` is a terminal; otherwise it starts nothing,
    and nothing is written."""

    def __init__(self, stream: IO[str] | None, interval: float, tick: Callable[[], None]) -> None:
        self._interval = interval
        self._tick = tick
        self._stopped = threading.Event()
        self._thread = (
            threading.Thread(target=self._run, name="dtrain-ticker", daemon=True)
            if is_terminal(stream)
            else None
        )

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> Ticker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self._tick()

"""Progress shown to a person: bars for copies and uploads, a status line for a running job.

Shown only where a person watches, a terminal: when the stream is a file or a pipe (tests, CI,
``| tee``, an agent's log) nothing is written, so captured output and logs stay as they were.
Every bar of dtrain comes from :func:`byte_bar`, one look for all of them.
"""

from __future__ import annotations

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

"""``dtrain run``'s console: whole lines from the controller and every rank, and, on a terminal,
one live line below them with the latest progress frame a rank is drawing (tqdm's bar), after
that rank's label.

Not on a terminal (a pipe, a file, CI) only whole lines are written: a progress line appears once,
as it ended, as it does in the job's logs.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterable
from typing import TextIO

from dtrain.progress import is_terminal

_CLEAR_LINE = "\r\x1b[K"


class Console:
    """Writes whole lines and redraws the live line around them; safe from several threads."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.live = is_terminal(stream)
        self._frame: tuple[object, str] | None = None
        """Who drew the live line, and what it shows."""
        self._lock = threading.Lock()

    def write(self, lines: Iterable[str], owner: object = None, frame: str | None = None) -> None:
        """Whole ``lines``, then, if ``owner`` (a rank) is given, the progress line it draws now
        (its label included) or, with ``frame=None``, none: its live line goes, unless another
        has drawn one since. One write, so no stale frame flashes between the two."""
        text = "".join(f"{line}\n" for line in lines)
        with self._lock:
            shown = self._frame
            if self.live and owner is not None:
                if frame is not None:
                    self._frame = (owner, frame)
                elif shown is not None and shown[0] == owner:
                    self._frame = None
            if not text and self._frame == shown:
                return
            self.stream.write(
                (_CLEAR_LINE if shown is not None else "")
                + text
                + (self._fitted(self._frame[1]) if self._frame is not None else "")
            )
            self.stream.flush()

    @staticmethod
    def _fitted(frame: str) -> str:
        """One row of the terminal: a line that wraps could no longer be cleared."""
        return frame[: max(shutil.get_terminal_size().columns - 1, 1)]

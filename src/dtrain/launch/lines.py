"""A rank's output cut into lines as a terminal would show them, and its live progress frame.

Progress bars (tqdm, ``print(..., end="\\r")``) redraw one line with carriage returns: a hundred
frames, then a newline. A terminal shows only the last state of that line, and so do the job's
logs: :func:`settle` overlays the frames as a terminal does, and the line is kept once. While such
a line is still being drawn, :func:`live_frame` is what a terminal would show of it now.
"""

from __future__ import annotations


def split_lines(pending: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    """The whole lines of ``pending + chunk`` (without their newline) and the rest, still
    pending. Bytes, not text, so a character cut between two reads stays whole."""
    *lines, rest = (pending + chunk).split(b"\n")
    return lines, rest


def settle(line: str) -> str:
    """What a terminal shows of ``line``: each carriage return starts over at the left margin
    and the next frame overwrites the previous one as far as it reaches (``"50%\\r7"`` shows
    ``"70%"``); a trailing ``"\\r"`` (a ``\\r\\n`` line end) changes nothing."""
    shown = ""
    for frame in line.split("\r"):
        shown = frame + shown[len(frame) :]
    return shown


def drawn_so_far(pending: bytes) -> bytes:
    """``pending`` with the frames before its last carriage return drawn into one: what a
    terminal shows of it is the same, and a progress bar that redraws for an hour does not
    keep (and settle again at every read) every frame it drew. A carriage return never falls
    inside a character, so the part before it decodes whole."""
    head, carriage_return, tail = pending.rpartition(b"\r")
    if not carriage_return:
        return pending
    return settle(head.decode("utf-8", errors="replace")).encode() + carriage_return + tail


def live_frame(pending: bytes) -> str | None:
    """The progress line being drawn, if the unfinished line is one (it holds a carriage
    return); ``None`` for a line merely written in pieces, which waits for its newline."""
    if b"\r" not in pending:
        return None
    return settle(pending.decode("utf-8", errors="replace"))

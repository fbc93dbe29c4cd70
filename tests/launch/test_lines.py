"""A rank's output as lines a terminal would show, its live progress frame, and the console that
draws that frame: pure functions and a fake terminal, no processes."""

from __future__ import annotations

import io

import pytest

from dtrain.launch.console import Console
from dtrain.launch.lines import drawn_so_far, live_frame, settle, split_lines


@pytest.mark.parametrize(
    "pending",
    [
        b"plain",
        b" 10%|#  |\r 50%|#####|\r 70",
        b"long frame\rshort\r",
        b"caf\xc3\xa9 \xff\r\xe2\x82",  # a broken byte before, half a character after
    ],
)
def test_frames_drawn_so_far_show_and_settle_the_same(pending: bytes) -> None:
    drawn = drawn_so_far(pending)
    assert drawn.count(b"\r") <= 1
    assert live_frame(drawn) == live_frame(pending)
    rest = "€".encode()[2:] if pending.endswith(b"\xe2\x82") else b""
    as_logged = [
        settle(raw.decode("utf-8", "replace")) for raw in split_lines(drawn, rest + b"\n")[0]
    ]
    assert as_logged == [settle((pending + rest).decode("utf-8", "replace"))]


def test_split_lines_keeps_the_unfinished_line_and_cut_characters() -> None:
    assert split_lines(b"", b"a\nb\nc") == ([b"a", b"b"], b"c")
    assert split_lines(b"c", b"d\n") == ([b"cd"], b"")
    euro = "€".encode()
    lines, rest = split_lines(b"", b"x\n" + euro[:1])
    assert (lines, split_lines(rest, euro[1:] + b"\n")[0]) == ([b"x"], [euro])


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        ("plain", "plain"),
        ("\r 10%|#         |\r 20%|##        |\r100%|##########|", "100%|##########|"),
        ("50%\r7", "70%"),  # a shorter frame overwrites only as far as it reaches
        ("loss 0.5\r", "loss 0.5"),  # a \r\n line end
        ("\r\r", ""),
    ],
)
def test_settle_is_what_a_terminal_shows(line: str, shown: str) -> None:
    assert settle(line) == shown


def test_the_live_frame_is_a_progress_line_being_drawn() -> None:
    assert live_frame(b"\r 10%|#  |\r 20%|## |") == " 20%|## |"
    assert live_frame(b"epoch 1 ... ") is None  # written in pieces: waits for its newline
    assert live_frame(b"") is None


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_console_draws_the_latest_frame_below_whole_lines() -> None:
    terminal = FakeTerminal()
    console = Console(terminal)
    console.write([], owner=0, frame="[algo-1,0]: 10%")
    console.write([], owner=1, frame="[algo-1,1]: 50%")  # the latest, whichever rank drew it
    console.write(["[dtrain job] Training"])
    console.write(["[algo-1,0]: 100%"], owner=0, frame=None)  # the live line stays rank 1's
    console.write(["[algo-1,1]: 100%"], owner=1, frame=None)
    assert terminal.getvalue() == (
        "[algo-1,0]: 10%"
        "\r\x1b[K[algo-1,1]: 50%"
        "\r\x1b[K[dtrain job] Training\n[algo-1,1]: 50%"
        "\r\x1b[K[algo-1,0]: 100%\n[algo-1,1]: 50%"
        "\r\x1b[K[algo-1,1]: 100%\n"
    )


def test_not_on_a_terminal_the_console_writes_whole_lines_only() -> None:
    stream = io.StringIO()
    console = Console(stream)
    console.write([], owner=0, frame="[algo-1,0]: 10%")
    console.write(["[algo-1,0]: 100%", "[algo-1,0]: done"], owner=0, frame=None)
    assert stream.getvalue() == "[algo-1,0]: 100%\n[algo-1,0]: done\n"

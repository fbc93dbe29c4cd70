"""The keeper's sweep, without processes: a scan that comes back empty once does not end it."""

from __future__ import annotations

from dtrain.launch import keeper


def sweep_over(scans: list[list[int]]) -> tuple[list[list[int]], int]:
    """What the sweep kills, and how many scans it made, over the given scan results."""
    killed: list[list[int]] = []
    made = 0

    def scan(marker: bytes) -> list[int]:
        nonlocal made
        made += 1
        return scans.pop(0) if scans else []

    keeper.sweep(b"DTRAIN_AGENT=t", scan, killed.append, lambda seconds: None)
    return killed, made


def test_a_process_seen_after_an_empty_scan_is_killed() -> None:
    """A rank's child in the middle of exec is missing from one scan, then shows."""
    assert sweep_over([[7], [], [8], [], []]) == ([[7], [8]], 5)


def test_two_empty_scans_in_a_row_end_it() -> None:
    assert sweep_over([[], []]) == ([], 2)


def test_a_process_that_keeps_forking_is_swept_a_bounded_number_of_times() -> None:
    killed, made = sweep_over([[9]] * 100)
    assert made == keeper.SWEEPS and killed == [[9]] * keeper.SWEEPS

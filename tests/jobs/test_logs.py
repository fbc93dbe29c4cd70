"""Rank logs as the controller writes them and ``dtrain logs`` prints them: labels, time order
across ranks, timestamps, a tail, ranks that wrote nothing. No job runs here."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from dtrain.jobs.folder import JobFolder
from dtrain.jobs.logs import RankLogWriter, labelled_logs, print_logs, stamp

T = 1_764_000_000.0  # 2025-11-24T16:00:00Z


def printed(logs: Path, **options: object) -> list[str]:
    out = io.StringIO()
    rank = options.pop("rank", None)
    attempt = options.pop("attempt", None)
    print_logs(lambda: labelled_logs(logs, rank, attempt), out, **options)  # type: ignore[arg-type]
    return out.getvalue().splitlines()


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    """Attempt 1 on two hosts (rank 2 silent) and a retry of rank 0."""
    folder = JobFolder(tmp_path)
    writer = RankLogWriter(folder)
    writer.start_attempt(1, {0: "algo-1", 1: "algo-1", 2: "algo-2"})
    writer.write(1, 1, [(T + 0.2, "one: second"), (T + 0.4, "one: fourth")])
    writer.write(1, 0, [(T + 0.1, "zero: first"), (T + 0.3, "zero: third")])
    writer.start_attempt(2, {0: "algo-1"})
    writer.write(2, 0, [(T + 5, "retried")])
    writer.close()
    return folder.logs_dir


def test_every_rank_has_a_log_from_its_start(logs: Path) -> None:
    assert (logs / "attempt-1" / "rank2.log").read_text() == ""
    assert printed(logs, rank=2) == []


def test_the_files_are_readable_lines_after_their_time(logs: Path) -> None:
    assert (logs / "attempt-1" / "rank0.log").read_text().splitlines() == [
        "2025-11-24T16:00:00.100000Z zero: first",
        "2025-11-24T16:00:00.300000Z zero: third",
    ]
    assert stamp(T) == "2025-11-24T16:00:00.000000Z"


def test_ranks_interleave_in_time_after_their_host_and_rank(logs: Path) -> None:
    assert printed(logs) == [
        "[algo-1,0]: zero: first",
        "[algo-1,1]: one: second",
        "[algo-1,0]: zero: third",
        "[algo-1,1]: one: fourth",
        "[algo-1,0 attempt 2]: retried",
    ]


def test_one_rank_one_attempt_timestamps_and_tail(logs: Path) -> None:
    assert printed(logs, rank=1) == ["one: second", "one: fourth"]
    assert printed(logs, rank=0) == ["zero: first", "zero: third", "[attempt 2]: retried"]
    assert printed(logs, attempt=2, timestamps=True) == [
        "2025-11-24T16:00:05.000000Z [algo-1,0]: retried"
    ]
    assert printed(logs, attempt=1, tail=2) == [
        "[algo-1,0]: zero: third",
        "[algo-1,1]: one: fourth",
    ]
    assert printed(logs, tail=0) == []


def test_logs_from_before_the_timestamps_still_print(tmp_path: Path) -> None:
    (tmp_path / "attempt-1").mkdir()
    (tmp_path / "attempt-1" / "rank0.log").write_text("old\nlines\n")
    assert printed(tmp_path) == ["[0]: old", "[0]: lines"]


def test_following_prints_a_line_once_it_has_settled(logs: Path) -> None:
    """While the job runs, a line younger than the settling time waits (a line of another
    host read at the same moment may still be on its way); the last pass prints the rest."""
    writer = RankLogWriter(JobFolder(logs.parent))
    writer.write(1, 2, [(T + 0.25, "two: late but early")])
    writer.write(2, 0, [(9e9, "from the future")])
    writer.close()
    passes = iter([False, True])
    out = io.StringIO()
    print_logs(
        lambda: labelled_logs(logs),
        out,
        follow=True,
        finished=lambda: next(passes),
        poll_interval=0,
    )
    lines = out.getvalue().splitlines()
    assert lines[:3] == [
        "[algo-1,0]: zero: first",
        "[algo-1,1]: one: second",
        "[algo-2,2]: two: late but early",
    ]
    assert lines[-1] == "[algo-1,0 attempt 2]: from the future" and len(lines) == 7

"""Live progress: step rates, status lines and byte bars on a terminal, silence elsewhere.

No real terminal is needed: a stream that says it is one (``isatty``) stands for it.
"""

from __future__ import annotations

import io
import re
import tarfile
import threading
from pathlib import Path

import pytest

from dtrain.jobs.channels import materialize_channel
from dtrain.jobs.live import format_elapsed, format_rate, latest, step_rate
from dtrain.jobs.metrics import MetricSample
from dtrain.jobs.spec import ChannelSpec, JobSpec
from dtrain.launch.artifacts import upload_artifacts
from dtrain.launch.job import JobRun, run_job
from dtrain.progress import Ticker, byte_bar, is_terminal
from tests.conftest import JOB_SCRIPTS, dtrain


class Terminal(io.StringIO):
    """What a terminal is to dtrain: a text stream whose ``isatty`` is true."""

    def isatty(self) -> bool:
        return True


def _samples(name: str, times: list[float]) -> list[MetricSample]:
    return [MetricSample(name, 1.0 / (i + 1), t, i) for i, t in enumerate(times)]


# --- step rate -----------------------------------------------------------------------------------


def test_step_rate_is_steps_over_seconds_of_the_recent_window() -> None:
    assert step_rate(_samples("loss", [100.0, 100.5, 101.0, 101.5, 102.0])) == pytest.approx(2.0)
    # Only the last `window` samples count: a slow start does not hide today's speed.
    slow_then_fast = _samples("loss", [0.0, 50.0, 100.0, 100.1, 100.2, 100.3])
    assert step_rate(slow_then_fast, window=4) == pytest.approx(10.0)
    assert step_rate(list(reversed(slow_then_fast)), window=4) == pytest.approx(10.0)


@pytest.mark.parametrize("times", [[], [5.0], [5.0, 5.0, 5.0]])
def test_no_step_rate_without_two_samples_apart_in_time(times: list[float]) -> None:
    assert step_rate(_samples("loss", times)) is None


def test_latest_is_the_busiest_metrics_last_sample_and_rate() -> None:
    # A loss each step, an accuracy each epoch: the loss counts the steps, even when the
    # accuracy came last.
    samples = _samples("loss", [0.0, 1.0, 2.0]) + _samples("acc", [0.5, 2.5])
    found = latest(samples)
    assert found is not None
    assert (found.sample.name, found.sample.step) == ("loss", 2)
    assert found.rate == pytest.approx(1.0)
    assert str(found) == "loss=0.3333 (1 steps/s)"
    slow = latest(_samples("acc", [0.0, 10.0]))
    assert slow is not None and str(slow) == "acc=0.5 (0.1 steps/s)"
    assert latest([]) is None


def test_formats() -> None:
    assert format_rate(2.5) == "2.5 steps/s"
    assert [format_rate(r) for r in (0.1, 1 / 30, 1.0, 99.96, 1234.4)] == [
        "0.1 steps/s", "0.0333 steps/s", "1 steps/s", "100 steps/s", "1234 steps/s"
    ]  # fmt: skip
    assert [format_elapsed(s) for s in (0, 42.9, 185, 7385)] == ["0s", "42s", "3m05s", "2h03m05s"]


# --- terminal or not -----------------------------------------------------------------------------


def test_is_terminal() -> None:
    closed = io.StringIO()
    closed.close()  # its isatty raises ValueError
    assert [is_terminal(s) for s in (Terminal(), io.StringIO(), None, closed)] == [
        True,
        False,
        False,
        False,
    ]


def test_a_bar_shows_sizes_on_a_terminal_and_nothing_elsewhere() -> None:
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        with byte_bar("channel train", 3 * 1024 * 1024, stream) as bar:
            bar.update(3 * 1024 * 1024)
    assert "channel train: 100%" in terminal.getvalue()
    assert "3.00M/3.00M" in terminal.getvalue()
    assert pipe.getvalue() == ""


def test_a_ticker_ticks_only_for_a_terminal() -> None:
    ticked = threading.Event()
    with Ticker(Terminal(), 0.01, ticked.set) as ticker:
        assert ticker.running
        assert ticked.wait(10)
    assert not ticker.running
    calls: list[int] = []
    with Ticker(io.StringIO(), 0.01, lambda: calls.append(1)) as quiet:
        assert not quiet.running  # no thread at all, so no tick can come later either
    assert calls == []


def test_channel_copies_report_their_bytes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.bin", "b.bin"):
        (data / name).write_bytes(b"x" * 2048)
    reports: list[tuple[int, int | None, bool]] = []
    materialize_channel(
        ChannelSpec("train", str(data)), tmp_path / "copy", 0, 1, lambda *r: reports.append(r)
    )
    assert reports == [(2048, 4096, False), (4096, 4096, False), (4096, 4096, True)]


def test_uploads_show_the_archives_bytes_on_a_terminal(tmp_path: Path) -> None:
    def collect(stream: str, tar: tarfile.TarFile) -> None:
        member = tarfile.TarInfo(f"{stream}.bin")
        member.size = 4096
        tar.addfile(member, io.BytesIO(b"\0" * 4096))

    terminal, pipe = Terminal(), io.StringIO()
    upload_artifacts("job", (tmp_path / "a").as_uri(), collect, terminal)
    upload_artifacts("job", (tmp_path / "b").as_uri(), collect, pipe)
    shown = terminal.getvalue()
    archive = (tmp_path / "a" / "job" / "output" / "model.tar.gz").stat().st_size
    assert f"model.tar.gz: {archive:.1f}B" in shown and "output.tar.gz:" in shown
    assert pipe.getvalue() == ""
    assert (tmp_path / "b" / "job" / "output" / "model.tar.gz").is_file()


# --- a running job -------------------------------------------------------------------------------


class _Watcher(Terminal):
    """A terminal that creates ``marker`` once a status line has shown the loss and its rate."""

    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.marker = marker

    def write(self, text: str) -> int:
        if re.search(r"\] Training: loss=\S+ \([0-9.]+ steps/s\)", text):
            self.marker.touch()
        return super().write(text)


def test_a_terminal_sees_the_latest_metric_while_a_job_trains(
    tmp_path: Path, dtrain_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "seen"
    console = _Watcher(marker)
    data = tmp_path / "data"
    data.mkdir()
    (data / "part-0.bin").write_bytes(b"x" * 3 * 1024)
    monkeypatch.setattr(JobRun, "STATUS_EVERY", 0.2)
    spec = JobSpec(
        entry_point="reports_loss.py",
        job_name="live",
        source_dir=str(JOB_SCRIPTS),
        instance_type="local_cpu",
        metric_definitions=({"Name": "loss", "Regex": "loss=([0-9.]+)"},),
        environment={"WAIT_FOR": str(marker)},
        channels=(ChannelSpec("train", str(data)),),
    )
    record = run_job(spec, console=console)
    assert record.status == "Completed", record.failure_reason
    shown = console.getvalue()
    status = [line for line in shown.splitlines() if "] Training: loss=" in line]
    assert status and status[-1].endswith(" steps/s)")
    # The host's copy of its channel, and the uploads, on bars with their sizes.
    assert "algo-1 train: 100%" in shown and "3.00k/3.00k" in shown
    assert "model.tar.gz:" in shown
    # `dtrain jobs` shows the job's elapsed time and its latest metric with its rate.
    listed = dtrain("jobs", home=dtrain_home).stdout.splitlines()
    assert listed[0].split() == [
        "NAME", "STATUS", "SECONDARY", "CREATED", "ELAPSED", "LAYOUT", "LATEST"
    ]  # fmt: skip
    row = next(line for line in listed if line.startswith("live "))
    assert "loss=" in row and "steps/s" in row and " 1x1 " in row

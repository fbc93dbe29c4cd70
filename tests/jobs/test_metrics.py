"""Metric definitions, extraction from log lines, plots and DescribeTrainingJob's final metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.errors import ConfigError, DtrainError
from dtrain.jobs.metrics import (
    MetricExtractor,
    MetricSample,
    final_metric_data_list,
    plot_metrics,
    validate_metric_definitions,
)

DEFINITIONS = [
    {"Name": "train:loss", "Regex": r"loss=([-+0-9.eE]+)"},
    {"Name": "val:acc", "Regex": r"val_acc: (\S+)"},
]


def _clock() -> Iterator[float]:
    value = 1_700_000_000.0
    while True:
        yield value
        value += 1.0


def _extractor(definitions: list[dict[str, str]] = DEFINITIONS) -> MetricExtractor:
    ticks = _clock()
    return MetricExtractor(validate_metric_definitions(definitions), clock=lambda: next(ticks))


def test_extracts_first_group_with_steps() -> None:
    extractor = _extractor(DEFINITIONS[:1])
    lines = ["epoch 1 loss=0.9", "nothing here", "epoch 2 loss=4.5e-1 loss=0.1", "loss=-1"]
    samples = [s for line in lines for s in extractor.feed(line)]
    assert samples == [
        MetricSample("train:loss", 0.9, 1_700_000_000.0, 0),
        MetricSample("train:loss", 0.45, 1_700_000_001.0, 1),
        MetricSample("train:loss", -1.0, 1_700_000_002.0, 2),
    ]


def test_multiple_metrics_count_steps_separately() -> None:
    extractor = _extractor()
    assert [(s.name, s.value, s.step) for s in extractor.feed("loss=2.0 val_acc: 0.5")] == [
        ("train:loss", 2.0, 0),
        ("val:acc", 0.5, 0),
    ]
    assert [(s.name, s.value, s.step) for s in extractor.feed("loss=1.0")] == [
        ("train:loss", 1.0, 1)
    ]
    assert [(s.name, s.value, s.step) for s in extractor.feed("val_acc: 0.75")] == [
        ("val:acc", 0.75, 1)
    ]


@pytest.mark.parametrize("line", ["val_acc: n/a", "val_acc: nan", "val_acc: inf", "val_acc: 1.2.3"])
def test_non_numeric_values_are_skipped(line: str) -> None:
    extractor = _extractor()
    assert extractor.feed(line) == []
    assert [s.step for s in extractor.feed("val_acc: 0.5")] == [0]


def test_optional_group_that_did_not_match_is_skipped() -> None:
    extractor = _extractor([{"Name": "lr", "Regex": r"lr(?:=([0-9.]+))?"}])
    assert extractor.feed("lr") == []
    assert [s.value for s in extractor.feed("lr=0.01")] == [0.01]


def test_validation_returns_compiled_definitions() -> None:
    parsed = validate_metric_definitions(tuple(DEFINITIONS))
    assert [(d.name, d.regex) for d in parsed] == [(d["Name"], d["Regex"]) for d in DEFINITIONS]
    assert validate_metric_definitions([]) == ()


@pytest.mark.parametrize(
    ("definitions", "match"),
    [
        ({"Name": "loss", "Regex": "loss=(.*)"}, "a list of"),
        ("loss=(.*)", "a list of"),
        (["loss=(.*)"], r"metric_definitions\[0\]"),
        ([{"Name": "loss"}], r"metric_definitions\[loss\]\.Regex: got None"),
        ([{"Regex": "loss=(.*)"}], r"metric_definitions\[0\]\.Name"),
        ([{"Name": "loss", "regex": "x(.)"}], "did you mean 'Regex'"),
        (
            [{"Name": "loss", "Regex": "loss=.*"}],
            r"\[loss\]\.Regex: got 'loss=\.\*'.*capture group",
        ),
        ([{"Name": "loss", "Regex": "loss=([0-9"}], r"\[loss\]\.Regex.*RE2 can run"),
        ([{"Name": "loss", "Regex": r"(a)\1"}], r"backreferences and lookarounds"),
        ([{"Name": "a", "Regex": "(x)"}, {"Name": "a", "Regex": "(y)"}], "at most once"),
    ],
)
def test_validation_errors(definitions: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate_metric_definitions(definitions)


def _samples() -> list[MetricSample]:
    extractor = _extractor()
    lines = [f"loss={1 / (i + 1)} val_acc: {i / 10}" for i in range(5)]
    return [s for line in lines for s in extractor.feed(line)]


def test_plot_writes_png(tmp_path: Path) -> None:
    path = tmp_path / "metrics.png"
    plot_metrics(_samples(), path, title="job-1")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 1000


def test_plot_without_samples(tmp_path: Path) -> None:
    with pytest.raises(DtrainError, match="no metric samples"):
        plot_metrics([], str(tmp_path / "empty.png"), title="job-1")


def test_final_metric_data_list() -> None:
    samples = _samples()
    assert final_metric_data_list(samples[::-1]) == [
        {"MetricName": "train:loss", "Value": 0.2, "Timestamp": "2023-11-14T22:13:28+00:00"},
        {"MetricName": "val:acc", "Value": 0.4, "Timestamp": "2023-11-14T22:13:29+00:00"},
    ]
    assert final_metric_data_list([]) == []


def test_a_pathological_regex_takes_linear_time() -> None:
    """``(a+)+b`` takes Python's ``re`` exponential time on a long run of ``a``; RE2 linear."""
    import time

    (definition,) = validate_metric_definitions([{"Name": "x", "Regex": "(a+)+b"}])
    started = time.perf_counter()
    assert MetricExtractor([definition]).feed("a" * 100_000) == []
    assert time.perf_counter() - started < 0.5

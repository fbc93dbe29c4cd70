"""Plans people can look at: why a cut was chosen, a folded table, the PNG, the progress line."""

from __future__ import annotations

import io
import itertools
import random
from pathlib import Path

import pytest
from matplotlib.image import imread
from torch import nn

from dtrain.cli import EXIT_BAD_INPUT, EXIT_OK, main
from dtrain.modelparallel.plan.memory import MemorySettings
from dtrain.modelparallel.plan.partition import costed_plan, manual_plan
from dtrain.modelparallel.plan.planview import (
    StageProgress,
    draw_plan,
    figure_data,
    plan_figure,
    unit_ranges,
)
from dtrain.modelparallel.plan.solver import _CUT_CHOICE, auto_plan
from tests.modelparallel.plan.test_partition import MS, chain, hand_profile, measures, splits

DEEP_MODEL = """
import torch
from torch import nn


def deep():
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)])


def sample_batch():
    return torch.randn(2, 64)
"""


@pytest.mark.parametrize("seed", range(20))
def test_the_reasons_counts_are_the_cuts_each_step_left(seed: int) -> None:
    """Every number the summary gives is checked by brute force: how many cuts there were,
    and how many each step of the choice left."""
    rng = random.Random(seed)
    n, partitions = rng.randint(2, 7), rng.randint(2, 4)
    names = [f"m{i}" for i in range(n)]
    modules = {"": (0.0, 0)} | {
        name: (rng.choice([1.0, 1.1, 2.0]) * MS, rng.choice([0, 400]), rng.choice([0, 10, 30]))
        for name in names
    }
    calls = [("", -1, 0, 0)] + [(name, 0, rng.choice([0, 1000]), 0) for name in names]
    profile = hand_profile(modules, calls)
    plan = auto_plan(profile, partitions, memory_weight=0.3, bandwidth=1e8)

    candidates = []
    for segments in splits(names, partitions, allow_empty=n < partitions):
        owners = {"": 0} | {name: k for k, seg in enumerate(segments) for name in seg}
        candidate = costed_plan(profile, partitions, owners, memory_weight=0.3, bandwidth=1e8)
        candidates.append(measures(candidate))
    assert plan.placeable == n
    assert plan.possible_cuts == len(candidates)
    assert [step.measure for step in plan.cut_choice] == [name for name, _ in _CUT_CHOICE]
    for step in plan.cut_choice:
        least = min(candidate[step.measure] for candidate in candidates)
        assert step.least == pytest.approx(least, rel=1e-9, abs=1e-12)
        candidates = [c for c in candidates if c[step.measure] <= step.limit + 1e-12]
        assert step.cuts == len(candidates), step


def test_the_reason_names_the_count_that_decided() -> None:
    """Two cuts are equally fast; the forward operations (100 against 110 on the largest
    partition) decide."""
    profile = hand_profile(
        {"": (0.0, 0), "m0": (MS, 0, 100), "m1": (MS, 0, 10), "m2": (MS, 0, 10)},
        [("", -1, 0, 0), ("m0", 0, 0, 0), ("m1", 0, 0, 0), ("m2", 0, 0, 0)],
    )
    plan = auto_plan(profile, 2, memory_weight=0.0)
    assert [plan.owner(name) for name in ("m0", "m1", "m2")] == [0, 1, 1]
    assert plan.why() == (
        "why this cut: 2 ways to cut 3 placeable parts; 2 within the noise band (largest "
        "partition cost at most 0.867: 30% over the least, 0.667); 1 of them with the most even "
        "forward operations (100 on the largest partition, or up to 3% more); that decided"
    )
    assert plan.why() in plan.table()


def test_the_reason_says_when_times_decide_or_nothing_does() -> None:
    by_time = auto_plan(chain([1, 1, 1, 1]), 2, memory_weight=0.0)
    assert by_time.why() is not None and by_time.why().endswith(  # type: ignore[union-attr]
        "1 within the noise band (largest partition cost at most 0.650: 30% over the least, "
        "0.500); the predicted times decided"
    )
    alike = auto_plan(chain([1, 1, 1]), 2, memory_weight=0.0)  # 1|2 and 2|1 tie on everything
    assert alike.why() is not None and alike.why().endswith(  # type: ignore[union-attr]
        "2 tie on every measure: the one with the earliest cuts was taken"
    )
    assert auto_plan(chain([1, 1]), 1, memory_weight=0.0).why() is None
    restored = type(alike).from_dict(alike.to_dict())
    assert restored.why() == alike.why()


def _nested_plan() -> tuple[object, object]:
    profile = hand_profile(
        {"": (0.0, 0), "a": (MS, 40), "a.x": (2 * MS, 400), "a.y": (MS, 4), "b": (4 * MS, 0)},
        [("", -1, 0, 0), ("a", 0, 0, 0), ("a.x", 1, 0, 0), ("a.y", 1, 0, 0), ("b", 0, 0, 0)],
    )
    return profile, auto_plan(profile, 2, memory_weight=0.0)


def _rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.split("\n\n")[0].splitlines()[1:]]


def test_depth_folds_modules_into_their_rows() -> None:
    _, plan = _nested_plan()
    full = _rows(plan.table())  # type: ignore[attr-defined]
    assert [row[0] for row in full] == ["(root)", "a", "x", "y", "b"]
    one = _rows(plan.table(1))  # type: ignore[attr-defined]
    assert [row[:2] for row in one] == [["(root)", "T"], ["a", "(+2)"], ["b", "Tb"]]
    assert one[1][5:7] == ["111", "4.000"]  # a's with x's and y's: 10 + 100 + 1, 1 + 2 + 1 ms
    root = _rows(plan.table(0))  # type: ignore[attr-defined]
    assert root == [["(root)", "(+4)", "T", "auto", "0,1", "111", "8.000", "1.3", "KiB", "1.000"]]
    folded = _rows(plan.table(folded=True))  # type: ignore[attr-defined]
    assert [row[:2] for row in folded] == [["(root)", "T"], ["a", "(+2)"], ["b", "Tb"]]


def test_the_drawing_shows_each_partitions_costs_and_memory(tmp_path: Path) -> None:
    _, plan = _nested_plan()
    plan = plan.with_memory(MemorySettings(optimizer="sgd"))  # type: ignore[attr-defined]
    data = figure_data(plan, "nested")
    assert data.title == "nested" and data.timed and data.why == plan.why()
    assert [bar.partition for bar in data.bars] == [0, 1]
    for bar, stage in zip(data.bars, plan.stages, strict=True):
        assert bar.compute_ms == pytest.approx(stage.compute_time * 1e3)
        assert bar.comm_ms == pytest.approx(stage.comm_time * 1e3)
        assert bar.flops == stage.flops
        assert sum(bar.memory.values()) == stage.peak_memory.total
    assert data.bars[0].label == "(root), a" and data.bars[1].label == "b"
    assert data.bars[0].memory["params"] == 444 and data.bars[0].memory["optimizer"] == 0

    path = tmp_path / "plan.png"
    draw_plan(plan, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(path).shape
    assert width == 1200 and 250 <= height <= 400
    assert path.stat().st_size > 10_000  # bars, labels and text, not a blank canvas


def test_a_plan_without_times_is_drawn_by_operations(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = manual_plan(model, 2, fixed={"1": 1}, default_partition=0)
    data = figure_data(plan)
    assert not data.timed and set(data.bars[0].memory) == {"planner"}
    draw_plan(plan, tmp_path / "manual.png")
    assert imread(tmp_path / "manual.png").shape[1] == 1200


def test_plan_command_with_depth_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / "deep.py"
    deep.write_text(DEEP_MODEL)
    png = tmp_path / "plan.png"
    argv = ["plan", f"{deep}:deep", "--partitions", "2", "--repeats", "1"]
    assert main([*argv, "--depth", "1", "--png", str(png)]) == EXIT_OK
    out, err = capsys.readouterr()
    assert err == ""  # no progress line: stderr is not a terminal here
    modules = out.split("\n\n")[0].splitlines()
    assert len(modules) == 1 + 7  # the header, the root and its 6 blocks folded
    assert modules[2].split()[:2] == ["0", "(+2)"]
    assert "why this cut: " in out and f"drawing written to {png}" in out
    assert imread(png).shape[1] == 1200

    assert main(argv) == EXIT_OK  # by default, folded below the placed units: the same rows
    default = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert [row.split()[:2] for row in default] == [row.split()[:2] for row in modules]

    assert main([*argv, "--depth", "-1"]) == EXIT_BAD_INPUT
    assert "--depth: got -1; allowed: an integer >= 0" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_only() -> None:
    terminal = _Terminal()
    progress = StageProgress(terminal)
    progress.stage("creating the model")
    progress.passes(1, 4, "timed pass 1 of 3")
    progress.done()
    frames = terminal.getvalue().split("\r\x1b[K")
    assert frames[1].startswith("dtrain plan: creating the model ... (")
    assert frames[2].startswith("dtrain plan: profiling [#####...............] timed pass 1 of 3")
    assert frames[-1] == ""  # the line is cleared before the plan prints

    pipe = io.StringIO()
    quiet = StageProgress(pipe)
    quiet.stage("creating the model")
    quiet.passes(4, 4, "profiled")
    quiet.done()
    assert pipe.getvalue() == ""


LONG_NAMES = [
    "token_embedding_table", "position_embedding_table",
    *(f"transformer_encoder_layers.{i}" for i in range(12)),
    "final_layer_normalization", "projection_to_vocabulary_with_a_name_longer_than_forty",
]  # fmt: skip


def test_units_are_named_with_numbered_siblings_as_ranges() -> None:
    assert unit_ranges(["(root)", "wte", "blocks.0", "blocks.1", "blocks.2", "lm_head"]) == [
        "(root)", "wte", "blocks.0–2", "lm_head"
    ]  # fmt: skip
    assert unit_ranges(["a.1", "a.3", "a.4", "b.5", "0", "1", "x.y.7", "x.y.8"]) == [
        "a.1", "a.3–4", "b.5", "0–1", "x.y.7–8"
    ]  # fmt: skip


@pytest.mark.parametrize("partitions", [1, 3, 8])
def test_every_partition_lists_all_its_units_inside_the_frame(partitions: int) -> None:
    """Partition 0 is listed as the others are (every unit, none left out for a count), and
    the drawing holds its text: every label inside the picture, beside its own row (within
    the axes' height, overlapping no other label), every figure after a bar inside its axes."""
    plan = auto_plan(chain([1] * len(LONG_NAMES), names=LONG_NAMES), partitions, memory_weight=0)
    data = figure_data(plan)
    listed = [unit for bar in data.bars for unit in bar.label.split(", ")]
    assert listed[0] == "(root)" and "units)" not in " ".join(listed)
    assert LONG_NAMES[-1] in listed
    numbered = [name for name in listed if name.startswith("transformer_encoder_layers.")]
    spans = [[int(n) for n in name.rpartition(".")[2].split("–")] for name in numbered]
    covered = [i for span in spans for i in range(span[0], span[-1] + 1)]
    assert covered == list(range(12))

    figure = plan_figure(plan)
    renderer = figure.canvas.get_renderer()
    picture = figure.bbox
    work, memory = figure.axes[:2]
    frame = work.get_window_extent(renderer)
    labels = [label.get_window_extent(renderer) for label in work.get_yticklabels()]
    assert len(labels) == partitions
    for box in labels:
        assert picture.x0 <= box.x0 and box.x1 <= frame.x0 and box.x1 <= picture.x1
        assert frame.y0 <= box.y0 and box.y1 <= frame.y1, (box, frame)
    for above, below in itertools.pairwise(labels):
        assert below.y1 < above.y0  # partition 0 on top, no two labels touching
    for ax in (work, memory):
        axes = ax.get_window_extent(renderer)
        for text in ax.texts:
            box = text.get_window_extent(renderer)
            assert axes.x0 <= box.x0 and box.x1 <= axes.x1, (text.get_text(), box, axes)
    drawn = figure.get_tightbbox(renderer).transformed(figure.dpi_scale_trans)
    assert picture.x0 <= drawn.x0 and drawn.x1 <= picture.x1  # title, legends, axes' labels,
    assert picture.y0 <= drawn.y0 and drawn.y1 <= picture.y1  # the reason: all inside

"""Docs generated from code stay in sync with it."""

from __future__ import annotations

from pathlib import Path

from dtrain.config import smpv2
from dtrain.config.modelparallel import schema_markdown, without_effect_markdown

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_model_parallel_parameter_table_is_current() -> None:
    assert schema_markdown().strip() in (DOCS / "distribution.md").read_text()


def test_the_parameters_accepted_without_effect_are_listed() -> None:
    assert without_effect_markdown().strip() in (DOCS / "modelparallel.md").read_text()


def test_smp_v2_parameter_table_is_current() -> None:
    assert smpv2.schema_markdown().strip() in (DOCS / "smp-v2.md").read_text()

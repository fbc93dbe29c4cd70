"""The stand-in for NVIDIA's Transformer Engine (``tests/smpv2/stand_ins``) serves exactly what
AWS's SMP v2 script touches with fp8 off, both at import in ``train_lib.py``: ``import
transformer_engine`` and ``from transformer_engine.common.recipe import Format, DelayedScaling``.
Everything the script's fp8 paths reach (``transformer_engine.pytorch.fp8_autocast`` and
``.checkpoint``, ``transformer_engine.pytorch.attention.MultiheadAttention``, a
``DelayedScaling(fp8_format=Format.HYBRID, ...)``) fails naming it."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

STAND_INS = Path(__file__).parent / "stand_ins"
SERVED = {
    "transformer_engine": set(),
    "transformer_engine.common": set(),
    "transformer_engine.common.recipe": {"Format", "DelayedScaling"},
}
"""Each module of the stand-in, and the names of its that AWS's script imports."""


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``transformer_engine`` imported from the stand-in, forgotten afterwards."""
    monkeypatch.syspath_prepend(str(STAND_INS))
    yield importlib.import_module("transformer_engine")
    for name in [n for n in sys.modules if n.partition(".")[0] == "transformer_engine"]:
        del sys.modules[name]


def test_the_scripts_imports_with_fp8_off_are_served(stand_in: ModuleType) -> None:
    from transformer_engine.common.recipe import DelayedScaling, Format  # noqa: F401

    assert Path(stand_in.__file__).is_relative_to(STAND_INS)
    assert not hasattr(stand_in, "__version__")  # probes find nothing, and fail nothing


def test_the_stand_in_serves_those_names_and_nothing_else(stand_in: ModuleType) -> None:
    files = sorted((STAND_INS / "transformer_engine").rglob("*.py"))
    modules = {
        ".".join(file.relative_to(STAND_INS).with_suffix("").parts).removesuffix(".__init__")
        for file in files
    }
    assert modules == set(SERVED)
    recipe = importlib.import_module("transformer_engine.common.recipe")
    public = {name for name, value in vars(recipe).items() if _defined_in(value, recipe)}
    assert public == SERVED["transformer_engine.common.recipe"]


def _defined_in(value: object, module: ModuleType) -> bool:
    return getattr(value, "__module__", None) == module.__name__ and not getattr(
        value, "__name__", "_"
    ).startswith("_")


@pytest.mark.parametrize(
    ("reach", "named"),
    [
        (lambda te: te.pytorch.fp8_autocast, "transformer_engine.pytorch"),
        (
            lambda te: te.common.recipe.Format.HYBRID,
            "transformer_engine.common.recipe.Format.HYBRID",
        ),
        (
            lambda te: te.common.recipe.DelayedScaling(amax_history_len=1024),
            "transformer_engine.common.recipe.DelayedScaling",
        ),
    ],
)
def test_the_fp8_paths_fail_naming_what_they_reach(
    stand_in: ModuleType, reach: object, named: str
) -> None:
    importlib.import_module("transformer_engine.common.recipe")
    with pytest.raises(
        ImportError, match=f"^{re.escape(named)}: Transformer Engine is NVIDIA's GPU library"
    ):
        reach(stand_in)  # type: ignore[operator]


def test_a_submodule_of_the_fp8_paths_is_missing(stand_in: ModuleType) -> None:
    with pytest.raises(ModuleNotFoundError, match=r"transformer_engine\.pytorch"):
        importlib.import_module("transformer_engine.pytorch.attention")

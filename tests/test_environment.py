"""dtrain's switches in the environment, read by one rule (``dtrain.environment``), without
processes: every switch takes the same words, keeps its default when unset or empty, and refuses
any other value naming itself."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dtrain.dataparallel.hierarchical import HIERARCHICAL_ENV, wants_hierarchical
from dtrain.dataparallel.shm import SHM_ENV, wants_shared_memory
from dtrain.errors import ConfigError
from dtrain.sealed import TRUST_STORE_ENV, trusts_store

READERS: dict[str, Callable[[], bool]] = {
    SHM_ENV: lambda: wants_shared_memory(None),
    HIERARCHICAL_ENV: lambda: wants_hierarchical(None, 2, 2, spans_world=True),  # auto: off
    TRUST_STORE_ENV: trusts_store,
}
"""Each switch through the code that reads it; each is off when unset."""

VALUES: list[tuple[str | None, bool | None]] = [
    (None, False),
    ("", False),
    ("  ", False),
    ("1", True),
    ("true", True),
    ("True", True),
    ("YES", True),
    (" on ", True),
    ("0", False),
    ("false", False),
    ("False", False),
    ("no", False),
    ("OFF", False),
    ("2", None),
    ("ture", None),
    ("enabled", None),
    ("-1", None),
]
"""A value, and what the switch reads (None: refused)."""


@pytest.mark.parametrize("name", READERS)
@pytest.mark.parametrize(("value", "expected"), VALUES)
def test_every_switch_reads_the_same_words_and_refuses_others(
    name: str, value: str | None, expected: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for other in READERS:
        monkeypatch.delenv(other, raising=False)
    if value is not None:
        monkeypatch.setenv(name, value)
    if expected is None:
        with pytest.raises(ConfigError, match=rf"^{name}: got {value!r}; allowed: one of 1, true"):
            READERS[name]()
    else:
        assert READERS[name]() is expected


def test_a_switch_set_on_or_off_overrides_the_automatic_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(HIERARCHICAL_ENV, "off")
    assert not wants_hierarchical(None, 4, 2, spans_world=True)  # auto would be on
    monkeypatch.setenv(HIERARCHICAL_ENV, "")
    assert wants_hierarchical(None, 4, 2, spans_world=True)

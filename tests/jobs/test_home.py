"""``DTRAIN_HOME``: created private when missing; an existing folder is used only if it is
already private, and its mode is never changed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dtrain.cli import main
from dtrain.errors import DtrainError
from dtrain.jobs.folder import dtrain_home, make_private_dirs

STRANGER = 4321
"""A uid that is not this test's user."""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _home_at(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTRAIN_HOME", str(path))


def test_a_missing_home_and_its_missing_parents_are_created_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "a" / "b"
    _home_at(home, monkeypatch)
    umask = os.umask(0o022)  # a common one, which would leave 0755
    try:
        assert dtrain_home() == home
    finally:
        os.umask(umask)
    assert _mode(home) == _mode(home.parent) == 0o700
    assert dtrain_home() == home and _mode(home) == 0o700  # found private: used as it is


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (0o1777, "can be written by its group or others (mode 1777): a shared folder"),
        (0o777, "can be written by its group or others (mode 0777)"),
        (0o770, "can be written by its group or others (mode 0770)"),
        (0o755, "can be read by its group or others (mode 0755)"),
        (0o710, "can be read by its group or others (mode 0710)"),
    ],
    ids=lambda value: oct(value) if isinstance(value, int) else "",
)
def test_an_existing_home_open_to_others_is_refused_and_left_as_it_is(
    mode: int, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    _home_at(shared, monkeypatch)
    with pytest.raises(DtrainError) as refused:
        dtrain_home()
    assert f"DTRAIN_HOME {shared} {expected}" in str(refused.value)
    assert ("chmod 700 it" in str(refused.value)) == (not mode & 0o022)  # never for a shared one
    assert _mode(shared) == mode
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder away needs root")
def test_another_users_home_is_refused_and_left_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, STRANGER, -1)
    _home_at(theirs, monkeypatch)
    with pytest.raises(DtrainError, match=f"belongs to another user \\(uid {STRANGER}\\)"):
        dtrain_home()
    assert _mode(theirs) == 0o755 and theirs.stat().st_uid == STRANGER


def test_every_command_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    _home_at(shared, monkeypatch)
    for command in (["jobs"], ["describe", "x"], ["prune", "--older-than", "1d"]):
        assert main(command) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"dtrain: error: DTRAIN_HOME {shared} can be written")
        assert error.count("\n") == 1 and "Traceback" not in error
    assert _mode(shared) == 0o1777


def test_a_folder_made_meanwhile_by_someone_else_is_checked_not_chmodded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between finding a folder missing and making it, another user may make it (in a shared
    folder such as /tmp): it is then theirs, and refused, never made private by dtrain."""
    target = tmp_path / "job-folder"
    mkdir = Path.mkdir

    def raced(path: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        if path == target and not target.exists():
            os.mkdir(target)
            os.chmod(target, 0o777)  # someone else's folder, open to all
        mkdir(path, mode, parents, exist_ok)

    monkeypatch.setattr(Path, "mkdir", raced)
    with pytest.raises(DtrainError, match="can be written by its group or others"):
        make_private_dirs(target)
    assert _mode(target) == 0o777

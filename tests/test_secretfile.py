"""Secret and token files: the same checks for ``--secret-file`` and ``dtrain ui --token-file``,
made on the name given and each link it leads through, never on a link's target alone."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from dtrain.cli import main
from dtrain.errors import ConfigError
from dtrain.launch.wire import read_secret
from dtrain.secretfile import MAX_SECRET_BYTES
from dtrain.ui.serve import read_token

STRANGER = 4321
"""A uid that is not this test's user: what another user of the machine would own."""
SECRET = "s" * 32

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")

READERS: list[Callable[[str], object]] = [read_secret, read_token]


def _private(path: Path, text: str = SECRET) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A folder every user may write, as ``/tmp`` is (sticky)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    return folder


@pytest.mark.parametrize("read", READERS)
def test_a_private_file_and_a_link_of_this_user_to_it_are_read(
    read: Callable[[str], object], tmp_path: Path
) -> None:
    file = _private(tmp_path / "secret")
    (tmp_path / "link").symlink_to(file)
    (tmp_path / "link-to-link").symlink_to("link")
    for name in ("secret", "link", "link-to-link"):
        assert read(str(tmp_path / name)) in (SECRET, SECRET.encode())


def test_a_dangling_link_as_secret_file_is_refused_clearly_and_nothing_is_created(
    shared: Path,
) -> None:
    target = shared / "elsewhere" / "nowhere"
    (shared / "job.secret").symlink_to(target)
    with pytest.raises(ConfigError, match=f"No such file or directory: {target}"):
        read_secret(str(shared / "job.secret"), create=True)
    assert not target.parent.exists()


def test_run_with_a_dangling_secret_file_is_refused_in_one_line(
    shared: Path, dtrain_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (shared / "job.secret").symlink_to(shared / "nowhere")
    (shared / "train.py").write_text("print('hi')\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = ["--cluster", f"join://127.0.0.1:{port}", "--secret-file", str(shared / "job.secret")]
    assert main(["run", str(shared / "train.py"), *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("dtrain: error: secret_file: got") and "Traceback" not in error
    assert error.count("\n") == 1 and "No such file or directory" in error


def test_a_missing_secret_file_is_created_private(tmp_path: Path) -> None:
    path = tmp_path / "new" / "job.secret"
    created = read_secret(str(path), create=True)
    assert len(created) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_secret(str(path), create=True) == created  # read again, not replaced


@needs_root
@pytest.mark.parametrize("read", READERS)
def test_another_users_link_is_not_followed_even_to_this_users_own_file(
    read: Callable[[str], object], tmp_path: Path, shared: Path
) -> None:
    mine = _private(tmp_path / "mine")
    link = shared / "job.secret"
    link.symlink_to(mine)
    os.lchown(link, STRANGER, -1)
    with pytest.raises(ConfigError, match=f"this link belongs to uid {STRANGER}"):
        read(str(link))
    # Nor through a link of this user's that leads to it.
    (tmp_path / "via").symlink_to(link)
    with pytest.raises(ConfigError, match=f"belongs to uid {STRANGER}"):
        read(str(tmp_path / "via"))


@needs_root
@pytest.mark.parametrize("read", READERS)
@pytest.mark.parametrize("mode", [0o600, 0o666], ids=oct)
def test_another_users_file_is_refused_whatever_its_mode(
    read: Callable[[str], object], mode: int, tmp_path: Path
) -> None:
    theirs = _private(tmp_path / "theirs")
    theirs.chmod(mode)
    os.chown(theirs, STRANGER, -1)
    with pytest.raises(ConfigError, match=f"a file of this user .*belongs to uid {STRANGER}"):
        read(str(theirs))


@pytest.mark.parametrize("read", READERS)
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o666], ids=oct)
def test_a_file_others_may_read_or_write_is_refused(
    read: Callable[[str], object], mode: int, tmp_path: Path
) -> None:
    file = _private(tmp_path / "secret")
    file.chmod(mode)
    with pytest.raises(ConfigError, match=f"mode is {mode:04o}; chmod 600 it"):
        read(str(file))
    file.chmod(0o400)
    read(str(file))


@pytest.mark.parametrize("read", READERS)
def test_a_folder_a_pipe_a_huge_file_or_a_loop_of_links_is_refused(
    read: Callable[[str], object], tmp_path: Path
) -> None:
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe, 0o600)  # opened without a writer: must not block
    huge = _private(tmp_path / "huge", "x" * (MAX_SECRET_BYTES + 1))
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    for path, expected in (
        (folder, "a regular file"),
        (pipe, "a regular file"),
        (huge, f"at most {MAX_SECRET_BYTES} bytes"),
        (tmp_path / "a", "at most 40 links"),
        (tmp_path / "missing", "No such file or directory"),
    ):
        with pytest.raises(ConfigError, match=expected):
            read(str(path))

"""A secret file of root's that a pod's user reads through its group: how Kubernetes mounts a
Secret for a pod with ``runAsUser`` and ``fsGroup`` (root's file, the pod's group, mode 0440,
reached through the ``..data`` links the kubelet makes). Read when only root may write it and
only that group may read it; refused otherwise."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dtrain.errors import ConfigError
from dtrain.launch.wire import read_secret
from dtrain.ui.serve import read_token

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="making root's files for a user needs root"
)

POD_USER = 4321
POD_GROUP = 4322
"""The pod's ``runAsUser`` and ``fsGroup``: no user or group of this machine."""
SECRET = "k" * 64
READERS: list[Callable[[str], object]] = [read_secret, read_token]


def mount(folder: Path, mode: int, group: int = POD_GROUP) -> Path:
    """A Secret volume as the kubelet lays it out: ``secret -> ..data/secret``, ``..data ->
    ..2026_12_07_00_00_00.1``, every entry root's; the file's group and mode as given."""
    volume = folder / "secret-volume"
    data = volume / "..2026_12_07_00_00_00.1"
    data.mkdir(parents=True)
    for made in (volume, data):
        os.chown(made, 0, group)
        made.chmod(0o2755)
    (data / "secret").write_text(SECRET)
    os.chown(data / "secret", 0, group)
    (data / "secret").chmod(mode)
    (volume / "..data").symlink_to(data.name)
    (volume / "secret").symlink_to("..data/secret")
    return volume / "secret"


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder the pod's user may walk through (a test's own tmp_path is root's alone)."""
    made = Path(tempfile.mkdtemp(prefix="dtrain-mounted-"))
    made.chmod(0o755)
    try:
        yield made
    finally:
        shutil.rmtree(made)


@pytest.fixture
def as_pod_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process, as the secret checks see it, is the pod's user in the pod's group (root
    opens every file anyway: what is tested is the rule; ``test_..._really`` drops root)."""
    monkeypatch.setattr(os, "geteuid", lambda: POD_USER)
    monkeypatch.setattr(os, "getegid", lambda: POD_USER)
    monkeypatch.setattr(os, "getgroups", lambda: [POD_GROUP])


@pytest.mark.usefixtures("as_pod_user")
@pytest.mark.parametrize("read", READERS)
@pytest.mark.parametrize("mode", [0o440, 0o640], ids=oct)
def test_roots_file_read_through_the_pods_group_is_read(
    read: Callable[[str], object], mode: int, folder: Path
) -> None:
    assert read(str(mount(folder, mode))) in (SECRET, SECRET.encode())


@pytest.mark.usefixtures("as_pod_user")
@pytest.mark.parametrize("read", READERS)
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(0o444, id="others-may-read"),
        pytest.param(0o460, id="the-group-may-write"),
        pytest.param(0o442, id="others-may-write"),
        pytest.param(0o400, id="not-read-through-the-group"),
    ],
)
def test_roots_file_others_may_read_or_the_group_write_is_refused(
    read: Callable[[str], object], mode: int, folder: Path
) -> None:
    with pytest.raises(ConfigError, match=f"belongs to uid 0; one of root's .*it has {mode:04o}"):
        read(str(mount(folder, mode)))


@pytest.mark.usefixtures("as_pod_user")
@pytest.mark.parametrize("read", READERS)
def test_roots_file_of_a_group_not_this_users_or_another_users_file_is_refused(
    read: Callable[[str], object], folder: Path
) -> None:
    with pytest.raises(ConfigError, match=f"group {POD_GROUP + 1}, and this user's groups"):
        read(str(mount(folder, 0o440, group=POD_GROUP + 1)))
    theirs = mount(folder / "theirs", 0o440)
    os.chown(theirs, POD_USER + 7, POD_GROUP)
    with pytest.raises(ConfigError, match=f"belongs to uid {POD_USER + 7}\\)"):
        read(str(theirs))


def read_as_pod_user(path: Path, groups: list[int]) -> str:
    """``read_secret(path)`` in a child that really is the pod's user with ``groups``: what it
    read, or the error's message."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        answer = "crashed"
        with contextlib.suppress(BaseException):
            os.setgroups(groups)
            os.setgid(POD_USER)
            os.setuid(POD_USER)
            try:
                answer = "read " + read_secret(str(path)).decode()
            except ConfigError as error:
                answer = str(error)
        os.write(writer, answer.encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        answer = pipe.read()
    os.waitpid(child, 0)
    return answer


def test_a_mounted_secret_is_read_by_the_pods_user_really(folder: Path) -> None:
    """Without ``fsGroup`` the file is root's alone (mode 0400): the pod's user cannot open it;
    with it, the pod's group reads it; a Secret others may read is refused."""
    assert read_as_pod_user(mount(folder, 0o440), [POD_GROUP]) == f"read {SECRET}"
    unreadable = read_as_pod_user(mount(folder / "0400", 0o400, group=0), [])
    assert "a readable file (Permission denied" in unreadable
    assert "one of root's" in read_as_pod_user(mount(folder / "0444", 0o444), [POD_GROUP])

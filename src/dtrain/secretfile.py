"""Files that hold a secret: a job's (``--secret-file``), the web view's token (``--token-file``).

Whoever reads such a file can join the job and run code on every machine, or read every job;
whoever can replace it, or point its name elsewhere, chooses the secret. So, as ssh does with a
private key, dtrain reads one only when

- the name given, and every symbolic link it leads through to the file, belongs to the user who
  runs dtrain or to root: another user's link (in a shared folder such as ``/tmp``, say) is
  refused, naming it, never followed;
- the file is a regular file of that user that nobody else may read or write (mode 0600 or
  0400), or a file of root that this user reads through a group of theirs, which nobody but root
  may write and nobody outside that group may read (mode 0440 or 0640): a Kubernetes Secret,
  mounted for a pod that runs as a user of its own with an ``fsGroup``, is such a file. Only root
  makes a file root's, so no other user can choose the secret; who else reads it is the group
  root chose (a pod's ``fsGroup`` is the pod's alone).

The file's checks are made on what was opened (``O_NOFOLLOW``, then ``fstat``), so nothing can be
swapped in between check and read. Each rule lives in one function (:func:`_link_refusal`,
:func:`_file_refusal`, :func:`_shared_by_root`), the same for both flags.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dtrain.errors import ConfigError

MAX_SECRET_BYTES = 64 * 1024
"""A secret is short: a longer file is not one (and is not read whole)."""
MAX_LINKS = 40
"""Links followed from the name given, as the kernel's own limit."""


def read_secret_file(key: str, path: str) -> bytes:
    """The content of ``path`` if the rules above hold, else a :class:`ConfigError` naming
    ``key`` (the flag), the path and what to do."""
    given = os.path.expanduser(path)
    file = _through_links(key, given)
    try:  # a link put there meanwhile is not followed; a pipe without a writer does not block
        descriptor = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as error:
        where = "" if file == given else f": {file}, where the link leads"
        raise ConfigError(key, path, f"a readable file ({error.strerror}{where})") from None
    try:
        refusal = _file_refusal(os.fstat(descriptor))
        if refusal is not None:
            raise ConfigError(key, path, refusal)
        content = b""
        while chunk := os.read(descriptor, MAX_SECRET_BYTES + 1 - len(content)):
            content += chunk
    finally:
        os.close(descriptor)
    if len(content) > MAX_SECRET_BYTES:
        raise ConfigError(key, path, f"a file of at most {MAX_SECRET_BYTES} bytes (a secret)")
    return content


def create_secret_file(path: str, content: bytes) -> None:
    """Write ``content`` to a new file at ``path`` (mode 0600, its missing folder 0700), unless
    something is there already, even a dangling link: that is then read as given, and checked."""
    file = Path(path).expanduser()
    file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        descriptor = os.open(file, flags, 0o600)
    except FileExistsError:
        return
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(content)


def _through_links(key: str, path: str) -> str:
    """Where ``path`` leads once every link its name is has been followed, each one checked."""
    current = path
    for _ in range(MAX_LINKS):
        try:
            info = os.lstat(current)
        except OSError:
            return current  # opening it says why
        if not stat.S_ISLNK(info.st_mode):
            return current
        refusal = _link_refusal(info)
        if refusal is not None:
            raise ConfigError(key, path, f"{refusal} ({current} -> {os.readlink(current)})")
        current = os.path.join(os.path.dirname(current), os.readlink(current))
    raise ConfigError(key, path, f"a file reached through at most {MAX_LINKS} links")


def _link_refusal(info: os.stat_result) -> str | None:
    """Why a symbolic link on the way to a secret is not followed, if it is not."""
    if info.st_uid not in (os.geteuid(), 0):
        return (
            f"a file, or a link of this user (uid {os.geteuid()}) or root; this link belongs "
            f"to uid {info.st_uid}, who chooses where it leads: give the file's own path"
        )
    return None


def _file_refusal(info: os.stat_result) -> str | None:
    """Why an opened file is not read as a secret, if it is not."""
    if not stat.S_ISREG(info.st_mode):
        return "a regular file (not a folder, a pipe or a device)"
    if _shared_by_root(info):
        return None
    if info.st_uid != os.geteuid():
        also = (
            "; one of root's only if it is read through this user's group, which alone may "
            f"read it, and only root may write it (mode 0440 or 0640; it has {_mode(info)}, "
            f"group {info.st_gid}, and this user's groups are {sorted(_groups())})"
        )
        return (
            f"a file of this user (uid {os.geteuid()}; it belongs to uid {info.st_uid}"
            f"{also if info.st_uid == 0 else ''})"
        )
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"a file only its owner can read (mode is {_mode(info)}; chmod 600 it)"
    return None


def _shared_by_root(info: os.stat_result) -> bool:
    """A file of root's that this user, not root, reads through a group of theirs: its group
    may read it and do nothing else, others nothing at all (a mounted Kubernetes Secret)."""
    return (
        info.st_uid == 0
        and os.geteuid() != 0
        and stat.S_IMODE(info.st_mode) & 0o077 == stat.S_IRGRP
        and info.st_gid in _groups()
    )


def _groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def _mode(info: os.stat_result) -> str:
    return f"{stat.S_IMODE(info.st_mode):04o}"

"""Limits a request must fit before anything launches: what the OS, JSON and S3 accept.

Each check names the key and the value, so a mistake is a one-line error instead of a traceback
from deep inside a launch (``E2BIG`` from ``exec``, ``RecursionError`` from JSON, an upload that
fails after hours of training for want of credentials).
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError, DtrainError
from dtrain.jobs.folder import check_own_folder

MAX_NESTING = 32
"""Levels of nested lists and dicts in hyperparameters, distribution and environment values."""
ARG_STRING_LIMIT = 128 * 1024
"""Linux's ``MAX_ARG_STRLEN``: the longest single argument or ``KEY=VALUE`` a process can get."""


def check_seconds(key: str, value: object) -> None:
    """A positive, finite number of seconds (``nan`` and ``inf`` would disable a limit)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, value, "a number of seconds > 0")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(key, value, "a finite number of seconds > 0")


def check_nesting(key: str, value: Any) -> None:
    """``value`` nests lists and dicts at most :data:`MAX_NESTING` deep."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_NESTING:
            raise ConfigError(key, "(a deeply nested value)", f"at most {MAX_NESTING} levels")
        if isinstance(item, Mapping):
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list | tuple):
            pending.extend((child, depth + 1) for child in item)


def check_no_nul(key: str, value: Any) -> None:
    """No string inside ``value`` holds a NUL: it cannot be passed to a process."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str) and "\0" in item:
            raise ConfigError(key, item, "text without NUL characters")
        if isinstance(item, Mapping):
            pending.extend([*item.keys(), *item.values()])
        elif isinstance(item, list | tuple):
            pending.extend(item)


def check_names(key: str, names: Mapping[str, Any], what: str) -> None:
    """Keys that can be an environment variable's name or a ``--key``: no ``=``, no NUL."""
    for name in names:
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ConfigError(key, name, f"non-empty {what} names without '=' or NUL")


def check_process_size(
    environment: Mapping[str, str], argv: list[str], user_environment: Mapping[str, str]
) -> None:
    """A rank with this environment (added to ours) and command line can be started.

    Linux refuses (``E2BIG``) any single string over :data:`ARG_STRING_LIMIT` and all of them
    together over ``ARG_MAX``. A variable the user set is named as ``environment.NAME``; the
    others carry hyperparameters.
    """
    strings = [f"{name}={value}" for name, value in environment.items()] + argv
    for string in strings:
        if len(string.encode()) >= ARG_STRING_LIMIT:
            shown = string.split("=", 1)[0] if "=" in string else string[:40]
            key = f"environment.{shown}" if shown in user_environment else "hyperparameters"
            raise ConfigError(
                key,
                f"{len(string.encode())} bytes in {shown}",
                f"at most {ARG_STRING_LIMIT} bytes in any one variable or argument (Linux's "
                "limit); pass large configuration as a file in a channel or the source dir",
            )
    inherited = sum(len(f"{k}={v}".encode()) + 9 for k, v in os.environ.items())
    total = inherited + sum(len(string.encode()) + 9 for string in strings)
    limit = os.sysconf("SC_ARG_MAX") if hasattr(os, "sysconf") else 2**21
    if total >= limit:
        raise ConfigError(
            "hyperparameters and environment",
            f"{total} bytes of environment and arguments",
            f"less than the {limit} bytes a process can be started with",
        )


def check_s3_ready(key: str, uri: str) -> None:
    """An ``s3://`` URI can be used from here: s3fs is installed and AWS credentials found."""
    if importlib.util.find_spec("s3fs") is None:
        raise ConfigError(
            key, uri, "an s3:// URI with s3fs installed (pip install s3fs: dtrain's s3 extra)"
        )
    import botocore.session

    sources = (
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, AWS_PROFILE or an "
        "instance role"
    )
    try:
        credentials = botocore.session.get_session().get_credentials()
    except Exception as error:  # a misconfigured profile or metadata endpoint
        raise ConfigError(key, uri, f"an s3:// URI with AWS credentials ({error})") from None
    if credentials is None:
        raise ConfigError(key, uri, f"an s3:// URI with AWS credentials: none found ({sources})")


def check_private_folder(key: str, path: str) -> None:
    """``path``, if it exists, is a folder of this user's that group and others cannot write."""
    folder = Path(path).expanduser()
    if folder.exists():
        try:
            check_own_folder(folder)
        except DtrainError as error:
            raise ConfigError(key, path, f"a folder of your own ({error})") from None


def check_writable_folder(key: str, path: str) -> None:
    """``path`` is, or can be created as, a folder this user can write: tried, not guessed
    from permission bits (root passes those everywhere, read-only file systems included)."""
    existing = Path(path).expanduser()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(key, path, f"a folder this user can write ({existing} is not a folder)")
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".dtrain-check-").cleanup()
    except OSError as error:
        raise ConfigError(
            key, path, f"a folder this user can write ({existing}: {error.strerror})"
        ) from None

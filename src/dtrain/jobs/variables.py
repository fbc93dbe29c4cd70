"""A job's environment variables from ``dtrain run``'s flags, as ``docker run`` takes them.

``--environment KEY=VALUE`` puts the value on the command line, which every user of the machine
can read (``ps``); ``--environment NAME`` takes the caller's own value and ``--environment-file
FILE`` reads them from a file (docker's ``--env-file`` format, :func:`read_environment_file`), so
that a credential never appears in any process's arguments. Files come first, then the flags,
in order: the last value given for a name wins, as with docker.

Unlike docker, which then leaves the variable unset, a name given without a value that the
caller's environment does not set is refused: a job never starts without a variable it was
asked to have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import ConfigError

BOM = "\ufeff"


@dataclass(frozen=True)
class JobVariables:
    """The job's variables, and which of them no command line showed."""

    values: dict[str, str]
    hidden: tuple[str, ...]
    """Names whose value came from the caller's environment or a file, not from a ``KEY=VALUE``
    on the command line: ``dtrain describe`` does not show these values."""


def job_variables(
    flags: Sequence[str], files: Sequence[str], caller: Mapping[str, str]
) -> JobVariables:
    """The variables ``--environment`` (each ``KEY=VALUE`` or ``NAME``) and
    ``--environment-file`` give, ``NAME`` read from ``caller`` (this process's environment)."""
    values: dict[str, str] = {}
    shown: dict[str, bool] = {}
    for path in files:
        for where, name, value in read_environment_file(path):
            values[name] = _value_of(f"--environment-file {path} {where}", name, value, caller)
            shown[name] = False
    for text in flags:
        name, equals, value = text.partition("=")
        if not name:
            raise ConfigError("--environment", text, "KEY=VALUE, or NAME for this shell's value")
        _check_name("--environment", name)
        given = value if equals else None
        values[name] = _value_of("--environment", name, given, caller)
        shown[name] = given is not None
    return JobVariables(values, tuple(name for name, seen in shown.items() if not seen))


def read_environment_file(path: str) -> list[tuple[str, str, str | None]]:
    """``(line N, NAME, VALUE)`` for each variable of an env file in docker's format (VALUE
    ``None`` for a name alone: the caller's value).

    The file is UTF-8 (a leading byte-order mark is dropped). Each line loses its leading white
    space; empty lines and lines starting with ``#`` are skipped. ``NAME=VALUE`` sets NAME to
    everything after the first ``=``, as written: quotes are part of the value, nothing is
    expanded, trailing space is kept (a ``\\r`` before the newline is not). ``NAME`` alone takes
    the caller's value. A name holds no white space. Errors name the line, never a value.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        allowed = f"a readable file ({error.strerror})"
        raise ConfigError("--environment-file", path, allowed) from None
    entries = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"line {number}"
        try:
            line = raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"--environment-file {path}", where, "UTF-8 text") from None
        if number == 1:
            line = line.removeprefix(BOM)
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        name, equals, value = line.partition("=")
        if not name:
            raise ConfigError(f"--environment-file {path}", where, "NAME=VALUE or NAME")
        _check_name(f"--environment-file {path} {where}", name)
        if "\0" in value:
            raise ConfigError(f"--environment-file {path}", where, "a value without NUL")
        entries.append((where, name, value if equals else None))
    return entries


def _check_name(key: str, name: str) -> None:
    if any(c.isspace() or c == "\0" for c in name):
        raise ConfigError(key, name, "a variable name without white space or NUL")


def _value_of(key: str, name: str, value: str | None, caller: Mapping[str, str]) -> str:
    """``value``, or for a name given alone, the caller's value of it."""
    if value is not None:
        return value
    if name not in caller:
        raise ConfigError(
            key,
            name,
            "a variable set in this shell's environment (export it first), or NAME=VALUE",
        )
    return caller[name]

"""A table of parameters as data, and what validating against it needs: SMP v1's and SMP v2's
parameters (``dtrain.config.modelparallel``, ``dtrain.config.smpv2``) are each one such table.

Every error names the dotted key, the value given and what is allowed, in the words the docs'
tables use (:func:`describe`), so a message and the docs cannot disagree. A job's parameters
reach its processes in the environment (:func:`job_parameters`) and win over a script's.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dtrain.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class Derived:
    """A default computed from other (already normalized) parameters."""

    description: str
    compute: Callable[[Mapping[str, Any]], Any]


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter: its type, default, allowed values, and what it needs from the others.

    ``requires`` pairs ``(other, value)`` must hold whenever this parameter is set away from its
    default (e.g. ``ddp_port`` needs ``ddp`` true).
    """

    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    requires: tuple[tuple[str, Any], ...] = ()
    nullable: bool = False
    limitation: str | None = None
    """Why dtrain allows less than SMP does (said wherever the allowed values are)."""
    without_effect: str | None = None
    """What dtrain does instead, for a parameter it accepts but does not act on: set away from
    its default, it warns, naming both."""


def show(value: Any) -> str:
    """Values as the user writes them in JSON (``true``, ``"speed"``)."""
    return json.dumps(value)


def describe(spec: ParameterSpec) -> str:
    """What ``spec`` allows, in words, for error messages and the docs table."""
    if spec.kind is bool:
        text = "true or false"
    elif spec.choices is not None:
        text = "one of " + ", ".join(show(c) for c in spec.choices)
    else:
        noun = "an integer" if spec.kind is int else "a number"
        low, high = spec.minimum, spec.maximum
        if low is not None and low == high:
            text = f"exactly {low:g}"
        elif low is not None and high is not None:
            text = f"{noun} from {low:g} to {high:g}"
        elif low is not None:
            text = f"{noun} >= {low:g}"
        else:
            text = noun
    text = f"{text} or null" if spec.nullable else text
    return f"{text} ({spec.limitation})" if spec.limitation else text


def _suggest(value: str, choices: tuple[str, ...]) -> str | None:
    """Closest choice, ignoring case so ``dpt`` finds ``DPT``."""
    by_lower = {c.lower(): c for c in choices}
    match = did_you_mean(value.lower(), by_lower)
    return by_lower[match] if match else None


def coerce(spec: ParameterSpec, value: Any, key: str) -> Any:
    """``value`` checked against ``spec``; bools may arrive as "true"/"false" strings."""
    if value is None and spec.nullable:
        return None
    if spec.kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(key, value, describe(spec))
        return value
    if spec.kind is str:
        if not isinstance(value, str) or value not in (spec.choices or ()):
            hint = _suggest(value, spec.choices or ()) if isinstance(value, str) else None
            raise ConfigError(key, value, describe(spec), hint)
        return value
    # JSON writes 5e8 as a float: accept whole-number floats where an integer is expected.
    if spec.kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    numeric = int if spec.kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, numeric):
        raise ConfigError(key, value, describe(spec))
    if (spec.minimum is not None and value < spec.minimum) or (
        spec.maximum is not None and value > spec.maximum
    ):
        raise ConfigError(key, value, describe(spec))
    return spec.kind(value)


def with_defaults(parameters: Sequence[ParameterSpec], given: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter of the table, in its order: the given value, else the default (derived
    ones computed from the others once those are known)."""
    values: dict[str, Any] = {}
    for spec in parameters:
        if spec.name in given:
            values[spec.name] = given[spec.name]
        elif not isinstance(spec.default, Derived):
            values[spec.name] = spec.default
    for spec in parameters:
        if isinstance(spec.default, Derived) and spec.name not in values:
            values[spec.name] = spec.default.compute(values)
    return {spec.name: values[spec.name] for spec in parameters}


def check_requires(
    parameters: Sequence[ParameterSpec], values: Mapping[str, Any], where: str
) -> None:
    """Each parameter set away from its default has what it ``requires`` from the others."""
    for spec in parameters:
        value = values[spec.name]
        if value == spec.default or value is None:
            continue
        for other, needed in spec.requires:
            if values[other] != needed:
                raise ConfigError(
                    f"{where}.{spec.name}",
                    value,
                    f"only together with {other}={show(needed)} "
                    f"(here {other}={show(values[other])})",
                )


def warn_without_effect(
    parameters: Sequence[ParameterSpec], values: Mapping[str, Any], where: str
) -> None:
    """One warning for each parameter set that dtrain accepts without acting on it (Python's
    default warning filter shows each once)."""
    for spec in parameters:
        if spec.without_effect is not None and values[spec.name] != spec.default:
            warnings.warn(
                f"{where}.{spec.name}={show(values[spec.name])} is accepted without effect: "
                f"{spec.without_effect}",
                stacklevel=3,
            )


def job_parameters(variable: str, what: str) -> dict[str, Any]:
    """The job's parameters, as SageMaker passes them to each process: a JSON object in the
    environment ``variable`` (``SM_HP_MP_PARAMETERS``); ``{}`` where it is unset or blank."""
    raw = os.environ.get(variable)
    if raw is None or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(variable, raw, f"a JSON object of {what}")
    return value


def warn_overridden(
    script: Mapping[str, Any],
    job: Mapping[str, Any],
    caller: str,
    where: str,
    source: str,
    stacklevel: int,
) -> None:
    """Warn about each parameter the script sets otherwise than the job, whose value wins (as on
    SageMaker, where the job's parameters override what a script passes to ``init``).
    ``caller`` names the script's call, ``source`` where the job's values come from."""
    for name in sorted(script.keys() & job.keys()):
        if script[name] != job[name]:
            warnings.warn(
                f"{caller}: {where}.{name} is {job[name]!r}, the job's value ({source}), "
                f"not the script's {script[name]!r}",
                stacklevel=stacklevel + 1,
            )


def table_markdown(
    parameters: Sequence[ParameterSpec], aliases: Mapping[str, str] | None = None
) -> str:
    """The parameter table for the docs, generated so it cannot drift from the validator;
    ``aliases`` maps an alias to the name it stands for."""
    rows = [
        "| parameter | allowed | default | requires | meaning |",
        "|---|---|---|---|---|",
    ]
    alias_of = {name: alias for alias, name in (aliases or {}).items()}
    for spec in parameters:
        name = f"`{spec.name}`" + (
            f" (alias `{alias_of[spec.name]}`)" if spec.name in alias_of else ""
        )
        default = (
            spec.default.description if isinstance(spec.default, Derived) else show(spec.default)
        )
        requires = ", ".join(f"`{other}={show(value)}`" for other, value in spec.requires)
        meaning = spec.help
        if spec.without_effect is not None:
            meaning += f" Accepted without effect: {spec.without_effect}."
        rows.append(f"| {name} | {describe(spec)} | {default} | {requires} | {meaning} |")
    return "\n".join(rows) + "\n"


def without_effect_table(parameters: Sequence[ParameterSpec]) -> str:
    """The parameters dtrain accepts without effect, and what it does instead, for the docs."""
    rows = ["| parameter | SMP | dtrain |", "|---|---|---|"]
    rows += [
        f"| `{spec.name}` | {spec.help} | {spec.without_effect} |"
        for spec in parameters
        if spec.without_effect is not None
    ]
    return "\n".join(rows) + "\n"

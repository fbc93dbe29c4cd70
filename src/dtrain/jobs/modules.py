"""``-m package.module`` entry points: the file that ``python -m`` would run, found in the job's
code before anything launches, with a near miss named when it is not there."""

from __future__ import annotations

from pathlib import Path

from dtrain.errors import ConfigError, did_you_mean


def module_file(source_dir: Path, module: str) -> Path:
    """``source_dir/a/b.py`` or ``source_dir/a/b/__main__.py`` for module ``a.b``, as ``python -m
    a.b`` finds it from ``source_dir`` (packages with or without ``__init__.py``)."""
    parts = module.split(".")
    if not all(part.isidentifier() for part in parts):
        raise ConfigError("-m", module, "a dotted module name, e.g. train or pkg.train")
    folder = source_dir
    for depth, part in enumerate(parts[:-1]):
        if not (folder / part).is_dir():
            raise _not_found(source_dir, parts, depth, folder)
        folder = folder / part
    last = parts[-1]
    for candidate in (folder / f"{last}.py", folder / last / "__main__.py"):
        if candidate.is_file():
            return candidate
    if (folder / last).is_dir():
        inside = ", ".join(_module_names(folder / last)) or "no modules"
        raise ConfigError(
            "-m", module, f"a module, or a package with a __main__.py ({module} holds: {inside})"
        )
    raise _not_found(source_dir, parts, len(parts) - 1, folder)


def _not_found(source_dir: Path, parts: list[str], depth: int, folder: Path) -> ConfigError:
    """``parts[depth]`` is not a package (or, last, a module) in ``folder``: what is there."""
    names = _module_names(folder)
    package = ".".join(parts[:depth])
    where = f"package {package}" if package else f"--source-dir {source_dir}"
    near = did_you_mean(parts[depth], [name for name in names if name != parts[depth]])
    return ConfigError(
        "-m",
        ".".join(parts),
        f"a module in --source-dir ({where} holds: {', '.join(names) or 'no modules'})",
        ".".join([*parts[:depth], near, *parts[depth + 1 :]]) if near else None,
    )


def _module_names(folder: Path) -> list[str]:
    """The modules and packages directly in ``folder``."""
    names = {
        path.stem if path.is_file() else path.name
        for path in folder.iterdir()
        if path.is_dir() or path.suffix == ".py"
    }
    return sorted(name for name in names if name.isidentifier() and not name.startswith("__"))

"""``torch.sagemaker.checkpoint.utils``: keeping only the newest checkpoint folders.

AWS's scripts name each checkpoint folder after its step (``llama-200steps``), match them with a
regex (``^.*\\d+steps$``), order them by the last number in the name (``SORT_BY_LAST_INT``) and,
after each save, call ``limit_num_subdirs`` with the path they saved to, which may be the
checkpoint's folder or a folder inside it (``llama-200steps/tp2-0``): the checkpoint folder is
the nearest of that path and its parents whose name matches the regex, and its siblings that
match are the checkpoints kept or removed.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtrain.smpv2.logger import get_logger


def SORT_BY_LAST_INT(path: str | os.PathLike[str]) -> int:  # SMP's name
    """The last integer in ``path``'s name: the order of checkpoints named by their step."""
    numbers = re.findall(r"\d+", Path(path).name)
    if not numbers:
        raise ValueError(f"SORT_BY_LAST_INT: {Path(path).name!r} holds no number")
    return int(numbers[-1])


def limit_num_subdirs(
    path: str | os.PathLike[str],
    num_kept: int,
    sort_fn: Callable[[Path], Any] = SORT_BY_LAST_INT,  # a sort key, as sorted() takes
    regex: str = r".*",
    log: bool = True,
) -> list[Path]:
    """Remove all but the newest ``num_kept`` checkpoint folders beside the one ``path`` is in
    (see the module), ordered by ``sort_fn``; returns those removed. Only the caller with
    ``log`` logs and removes (AWS's scripts call it on every rank with ``log=rank == 0``)."""
    if "://" in os.fspath(path):
        raise ValueError(f"limit_num_subdirs: {os.fspath(path)} is not a local folder")
    if num_kept < 1:
        raise ValueError(f"limit_num_subdirs: num_kept must be at least 1, got {num_kept}")
    pattern = re.compile(regex)
    here = Path(path).absolute()
    checkpoint = next((p for p in (here, *here.parents) if pattern.match(p.name)), None)
    if checkpoint is None or not checkpoint.parent.is_dir() or not log:
        return []
    found = [p for p in checkpoint.parent.iterdir() if p.is_dir() and pattern.match(p.name)]
    removed = sorted(found, key=sort_fn)[:-num_kept]
    logger = get_logger()
    for old in removed:
        logger.info("Removing checkpoint %s (keeping the newest %d)", old, num_kept)
        shutil.rmtree(old)
    return removed

"""``import torch.sagemaker`` (SMP v2) without writing into the installed torch.

``torch`` is a real package, so ``torch.sagemaker`` is looked up only in ``torch.__path__``, not on
``PYTHONPATH`` where the ``smdistributed`` shim sits. :class:`TorchSagemakerFinder` answers that
one name with the package :mod:`dtrain.compat.torch_sagemaker`'s folder; the import system then
finds its submodules (``torch.sagemaker.utils``...) there as in any package. The finder comes last
among the import system's finders, so a real ``torch.sagemaker`` (AWS's containers ship one in
their torch) is found first and never shadowed.

:func:`install` puts the finder in place. torch calls it at the end of ``import torch``, as it
calls every entry point of the ``torch.backends`` group (torch's autoloading of out-of-tree
extensions, pytorch/pytorch#122468; dtrain declares its entry point in ``pyproject.toml``). So
``torch.sagemaker`` imports in every interpreter of an environment where dtrain is installed:
the ranks of a job, ``torchrun train.py`` with no wrapper, processes a script spawns, and a script
whose first import is ``torch.sagemaker`` (which imports torch first). With
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` torch autoloads nothing, and ``torch.sagemaker`` is missing.
Where dtrain runs from its source tree (``PYTHONPATH=src``), no entry point is declared: there
the rank runner (:mod:`dtrain.launch.entry`) installs the finder for the script it runs.
This module imports nothing but the standard library: it runs inside every ``import torch``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

NAME = "torch.sagemaker"
PACKAGE = Path(__file__).resolve().parent / "torch_sagemaker"


class TorchSagemakerFinder(MetaPathFinder):
    """Finds ``torch.sagemaker``: the package :data:`PACKAGE`, under that name."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != NAME:
            return None
        return importlib.util.spec_from_file_location(
            NAME, PACKAGE / "__init__.py", submodule_search_locations=[str(PACKAGE)]
        )


def install() -> None:
    """Make ``torch.sagemaker`` importable in this interpreter; idempotent."""
    if not any(isinstance(finder, TorchSagemakerFinder) for finder in sys.meta_path):
        sys.meta_path.append(TorchSagemakerFinder())

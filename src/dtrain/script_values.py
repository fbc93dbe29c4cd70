"""Reading values a training script saved (SMP v1's ``user_content`` and ``smp.load`` files, the
non-tensor entries of SMP v2's distributed checkpoints) without unpickling code.

They are read with ``torch.load(weights_only=True)``, which admits tensors, containers and plain
values, plus the data-only classes scripts put there: numpy's scalars and arrays of plain dtypes
and Hugging Face configs, rebuilt from the file's values (AWS's GPT-2 script saves a numpy
parameter count and its ``GPT2Config``; at most a config's constructor runs). A planted file
cannot run code of its own; anything else needs the caller's ``weights_only=False``, its
explicit trust in the file.
"""

from __future__ import annotations

import functools
import importlib
import sys
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

Source = Path | IO[bytes]
"""A file, or a seekable binary stream holding what ``torch.save`` wrote."""


def read_script_values(source: Source, weights_only: bool = True, map_location: Any = "cpu") -> Any:
    """What ``torch.save`` wrote to ``source``: as weights only, plus the data-only types scripts
    put there (:func:`_data_classes`); anything else needs the caller's ``weights_only=False``."""
    if not weights_only:
        return torch.load(_rewound(source), map_location=map_location, weights_only=False)
    with torch.serialization.safe_globals(_data_classes(source)):
        return torch.load(_rewound(source), map_location=map_location, weights_only=True)


def _rewound(source: Source) -> Source:
    if not isinstance(source, Path):
        source.seek(0)
    return source


def _data_classes(source: Source) -> list[Any]:
    """Classes whose objects are rebuilt from data alone: numpy's scalars and arrays of plain
    dtypes (object and structured dtypes stay refused) and the Hugging Face configs ``source``
    names (at most a config's constructor runs, on values from the file). Files in torch's old
    format cannot be listed: numpy's only, and torch's loader decides."""
    if not zipfile.is_zipfile(_rewound(source)):
        return _numpy_classes()
    named = torch.serialization.get_unsafe_globals_in_checkpoint(_rewound(source))
    return _numpy_classes() + [c for c in map(_hf_config, named) if c is not None]


@functools.cache
def _numpy_classes() -> list[Any]:
    plain = [
        getattr(np.dtypes, name)
        for name in dir(np.dtypes)
        if name.endswith("DType") and name not in ("ObjectDType", "VoidDType")
    ]
    multiarray = np._core.multiarray  # type: ignore[attr-defined]  # numpy 2's, not in its stubs
    return [multiarray.scalar, multiarray._reconstruct, np.dtype, np.ndarray, *plain]


def _hf_config(name: str) -> type | None:
    """The config class ``name`` names, if it is one of the installed ``transformers``' own
    (its table of model types), else None: nothing else is imported."""
    module_name, _, attribute = name.rpartition(".")
    if not module_name.startswith("transformers.models.") or "transformers" not in sys.modules:
        return None
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if attribute not in CONFIG_MAPPING_NAMES.values():
        return None
    try:
        found = getattr(importlib.import_module(module_name), attribute, None)
    except ImportError:  # a newer transformers' model, or an optional dependency missing
        return None
    ok = isinstance(found, type) and issubclass(found, PretrainedConfig)
    return found if ok else None

"""What reading a distributed checkpoint may unpickle: nothing but what a checkpoint holds.

torch's DCP readers unpickle a checkpoint's ``.metadata`` file with ``pickle.load`` and each of
its non-tensor entries with ``torch.load(weights_only=False)``: a planted file runs code. Here
the metadata is read by an unpickler that knows only DCP's metadata classes (and
``torch.Size``, dtypes, layouts, paths: what torch writes there), and each non-tensor entry is
read as SMP v1's ``user_content`` is, weights only (:mod:`dtrain.script_values`), before the
planner sees it. Tensors are torch's ``weights_only=True`` already.
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from dtrain.script_values import read_script_values

_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
"""What torch pickles into ``.metadata``: its classes, and what their fields hold."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"a checkpoint's metadata names {module}.{name}, which torch's distributed "
            "checkpoints never hold: refused"
        )


def read_metadata(stream: IO[bytes]) -> Metadata:
    """The ``Metadata`` pickled in ``stream``, refusing anything else."""
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"a checkpoint's metadata is a {type(metadata).__name__}")
    return metadata


class WeightsOnlyBytes:
    """A load planner whose non-tensor entries are read as weights only before it sees them
    (torch's planners read them with ``weights_only=False``): what it gets is what
    ``read_script_values`` rebuilt, saved again."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            rebuilt = read_script_values(value)
        except pickle.UnpicklingError as error:
            raise pickle.UnpicklingError(
                f"checkpoint entry {read_item.dest_index.fqn!r} holds more than tensors, plain "
                f"values, numpy's and Hugging Face configs: {error}; read it with "
                "DistributedFileSystemReader(..., weights_only=False) if you trust the file"
            ) from error
        saved = io.BytesIO()
        torch.save(rebuilt, saved)
        saved.seek(0)
        self._planner.load_bytes(read_item, saved)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

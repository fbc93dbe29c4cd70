"""``torch.sagemaker.distributed.checkpoint.filesystem``: where distributed checkpoints are
written and read, a local folder or an ``s3://`` prefix, through fsspec (torch's fsspec storage;
``s3fs`` for S3, credentials and endpoint from the usual AWS environment).

The reader is torch's, but for what it unpickles (:mod:`.unpickling`) and one check torch's
planner leaves out: every element a rank asks for must be in the checkpoint. A checkpoint saved
by ranks that held only part of a tensor (a replica group that never saved, a tensor-parallel
slice's folder read at another degree) otherwise leaves the rest of the tensor as it was.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any

from torch import Tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.tensor import DTensor
from torch.futures import Future

from dtrain.smpv2.checkpoint.unpickling import WeightsOnlyBytes, read_metadata

CheckpointPath = str | os.PathLike[str]


def checkpoint_path(path: CheckpointPath) -> str:
    """``path`` as fsspec takes it; an ``s3://`` URL that went through ``pathlib`` (which
    collapses its ``//``, as AWS's scripts' ``Path(checkpoint_dir)`` does) made whole again."""
    text = os.fspath(path)
    if text.startswith("s3:/") and not text.startswith("s3://"):
        text = "s3://" + text[len("s3:/") :]
    return text


class DistributedFileSystemWriter(FsspecWriter):
    """Writes a distributed checkpoint to ``path``, a folder or an ``s3://`` prefix: one file
    per rank and a ``.metadata`` file from the coordinator (torch's format)."""

    def __init__(self, path: CheckpointPath, **options: Any) -> None:
        super().__init__(checkpoint_path(path), **options)

    def reset(self, checkpoint_id: CheckpointPath | None = None) -> None:
        super().reset(checkpoint_path(checkpoint_id) if checkpoint_id else None)


class DistributedFileSystemReader(FsspecReader):
    """Reads a distributed checkpoint from ``path``, a folder or an ``s3://`` prefix, refusing
    to unpickle anything but its metadata and plain values (``weights_only=False`` trusts the
    checkpoint's non-tensor entries to hold objects of the script's own classes)."""

    def __init__(self, path: CheckpointPath, weights_only: bool = True, **options: Any) -> None:
        super().__init__(checkpoint_path(path), **options)
        self.weights_only = weights_only
        self._tensors: set[str] = set()

    def reset(self, checkpoint_id: CheckpointPath | None = None) -> None:
        super().reset(checkpoint_path(checkpoint_id) if checkpoint_id else None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """torch's, unpickling only what metadata holds."""
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata(stream)  # type: ignore[arg-type]  # a binary stream
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = {
            fqn
            for fqn, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._check_covered(plan, planner)
        if self.weights_only:
            planner = WeightsOnlyBytes(planner)  # type: ignore[assignment]  # a planner's proxy
        return super().read_data(plan, planner)

    def _check_covered(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Fail unless ``plan`` reads every element of every tensor this rank asks for that the
        checkpoint has (``planner.state_dict``, flattened, as torch's planners keep it)."""
        wanted = getattr(planner, "state_dict", None)
        if not isinstance(wanted, dict):
            return
        read: Counter[str] = Counter()
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                read[item.dest_index.fqn] += math.prod(item.lengths)
        for fqn, value in wanted.items():
            local = _local_numel(value)
            if fqn in self._tensors and local is not None and read[fqn] != local:
                raise ValueError(
                    f"checkpoint {self.path}: {fqn} holds only {read[fqn]} of the {local} "
                    "elements this rank asks for: the ranks that saved it held only part of it "
                    "(a replica that did not save, another tensor-parallel slice's folder)"
                )


def _local_numel(value: object) -> int | None:
    """How many elements of ``value`` this rank holds, if it is a tensor."""
    if isinstance(value, DTensor):
        return value.to_local().numel()
    if isinstance(value, ShardedTensor):
        return sum(shard.tensor.numel() for shard in value.local_shards())
    if isinstance(value, Tensor):
        return value.numel()
    return None

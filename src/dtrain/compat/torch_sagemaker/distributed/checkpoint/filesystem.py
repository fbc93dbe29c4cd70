"""``torch.sagemaker.distributed.checkpoint.filesystem``:
see :mod:`dtrain.smpv2.checkpoint.storage`."""

from dtrain.smpv2.checkpoint.storage import DistributedFileSystemReader, DistributedFileSystemWriter

__all__ = ["DistributedFileSystemReader", "DistributedFileSystemWriter"]

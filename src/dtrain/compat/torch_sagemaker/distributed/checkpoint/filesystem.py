"""``torch.sagemaker.distributed.checkpoint.filesystem``."""

from dtrain.smpv2.unavailable import Unavailable

_HERE = "torch.sagemaker.distributed.checkpoint.filesystem"
DistributedFileSystemReader = Unavailable(f"{_HERE}.DistributedFileSystemReader")
DistributedFileSystemWriter = Unavailable(f"{_HERE}.DistributedFileSystemWriter")

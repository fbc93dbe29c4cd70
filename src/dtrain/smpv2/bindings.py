"""Which of the script's modules hold torch's own FSDP, bound before ``import torch.sagemaker``
put SMP v2's under torch's names (:mod:`dtrain.compat.torch_fsdp`): an FSDP they build shards as
torch's does, not over SMP's groups, and ``tsm.init`` says so."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard
from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

TORCH_FSDP = (FullyShardedDataParallel, fully_shard)

_LIBRARIES = tuple(
    Path(sysconfig.get_paths()[kind]).resolve()
    for kind in ("stdlib", "platstdlib", "purelib", "platlib")
)


def modules_holding_torch_fsdp() -> list[str]:
    """The script's modules (``__main__`` and modules outside the interpreter's libraries and
    dtrain) whose globals hold torch's own ``FullyShardedDataParallel`` or ``fully_shard``."""
    found = []
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] == "dtrain" or not _is_the_scripts(name, module):
            continue
        values = getattr(module, "__dict__", {}).values()
        if any(value is held for value in values for held in TORCH_FSDP):
            found.append(name)
    return sorted(found)


def _is_the_scripts(name: str, module: object) -> bool:
    if name == "__main__":
        return True
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return False
    path = Path(file).resolve()
    return not any(path.is_relative_to(library) for library in _LIBRARIES)

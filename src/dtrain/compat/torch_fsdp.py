"""SMP v2's FSDP under torch's names, in processes that import ``torch.sagemaker``.

SMP ships a torch whose FSDP shards over SMP's groups and takes ``post_param_init_fn``; AWS's
scripts name it as torch exports it (``from torch.distributed.fsdp import
FullyShardedDataParallel as FSDP``, ``fully_shard``). :func:`install` rebinds those names in
``torch.distributed.fsdp`` (and FSDP2's older home, ``torch.distributed._composable.fsdp``), in
memory, to :mod:`dtrain.smpv2.fsdp`'s, which are torch's own until ``tsm.init()``: the installed
torch is left as it is, and an interpreter that never imports ``torch.sagemaker`` never sees them.

A name is looked up when the script imports it, so a module that imported it before
``torch.sagemaker`` holds torch's own: AWS's scripts import ``torch.sagemaker`` first; ``tsm.init``
warns naming any module of the script's that did not (:mod:`dtrain.smpv2.bindings`).
"""

from __future__ import annotations

import torch.distributed._composable.fsdp as composable_fsdp
import torch.distributed.fsdp as fsdp

from dtrain.smpv2.fsdp import FullyShardedDataParallel, fully_shard


def install() -> None:
    """Rebind torch's FSDP names to SMP v2's; idempotent."""
    fsdp.FullyShardedDataParallel = FullyShardedDataParallel  # type: ignore[misc]  # rebinding a class name is the point
    fsdp.fully_shard = fully_shard
    composable_fsdp.fully_shard = fully_shard

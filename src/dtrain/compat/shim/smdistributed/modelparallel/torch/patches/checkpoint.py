"""``smdistributed.modelparallel.torch.patches.checkpoint``: SMP's activation checkpointing
(see :mod:`dtrain.modelparallel.activations`)."""

from dtrain.modelparallel.activations import (
    checkpoint,
    checkpoint_sequential,
    set_activation_checkpointing,
)

__all__ = ["checkpoint", "checkpoint_sequential", "set_activation_checkpointing"]

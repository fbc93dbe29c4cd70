"""``smdistributed.modelparallel.torch.patches.checkpoint``: SMP's activation checkpointing
(see :mod:`dtrain.modelparallel.pipeline.activations`)."""

from dtrain.modelparallel.pipeline.activations import (
    checkpoint,
    checkpoint_sequential,
    set_activation_checkpointing,
)

__all__ = ["checkpoint", "checkpoint_sequential", "set_activation_checkpointing"]

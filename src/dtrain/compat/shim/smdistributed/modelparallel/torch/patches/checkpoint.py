"""``smdistributed.modelparallel.torch.patches.checkpoint``: SMP's activation checkpointing
(see :mod:`dtrain.modelparallel.modules.checkpoint`)."""

from dtrain.modelparallel.modules.activations import set_activation_checkpointing
from dtrain.modelparallel.modules.checkpoint import checkpoint, checkpoint_sequential

__all__ = ["checkpoint", "checkpoint_sequential", "set_activation_checkpointing"]

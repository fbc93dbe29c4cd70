"""``smdistributed.modelparallel.torch.state_mod``: SMP's state object, ``smp.state`` (see
``dtrain.modelparallel.api.smp_state``)."""

from dtrain.modelparallel.api.smp_state import smp_state as state

__all__ = ["state"]

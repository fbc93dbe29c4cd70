"""``torch.sagemaker.distributed.checkpoint.state_dict_utils``:
see :mod:`dtrain.smpv2.checkpoint.local_state`."""

from dtrain.smpv2.checkpoint.local_state import (
    SMStateDictType,
    init_optim_state,
    sm_state_dict_type,
)

__all__ = ["SMStateDictType", "init_optim_state", "sm_state_dict_type"]

"""``smdistributed.modelparallel.torch.sharded_data_parallel_checkpoint``: see
``dtrain.modelparallel.api.sharded_checkpoint``."""

from dtrain.modelparallel.api.sharded_checkpoint import (
    get_full_state_dict_from_sharded_data_parallel_checkpoint,
)

__all__ = ["get_full_state_dict_from_sharded_data_parallel_checkpoint"]

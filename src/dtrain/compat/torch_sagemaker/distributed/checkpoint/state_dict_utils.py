"""``torch.sagemaker.distributed.checkpoint.state_dict_utils``."""

from dtrain.smpv2.unavailable import Unavailable

_HERE = "torch.sagemaker.distributed.checkpoint.state_dict_utils"
sm_state_dict_type = Unavailable(f"{_HERE}.sm_state_dict_type")
SMStateDictType = Unavailable(f"{_HERE}.SMStateDictType")
init_optim_state = Unavailable(f"{_HERE}.init_optim_state")

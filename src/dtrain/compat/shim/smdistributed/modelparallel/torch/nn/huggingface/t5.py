"""``smdistributed.modelparallel.torch.nn.huggingface.t5``: see
``dtrain.modelparallel.tensor.huggingface.t5``."""

from dtrain.modelparallel.tensor.huggingface.t5 import (  # noqa: F401  (the module is the API)
    get_hf_t5_transformer_layer_hooks,
    translate_hf_state_dict_to_smdistributed,
    translate_state_dict_to_hf_t5,
)

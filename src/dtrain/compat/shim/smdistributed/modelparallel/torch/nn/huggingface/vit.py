"""``smdistributed.modelparallel.torch.nn.huggingface.vit``: see
``dtrain.modelparallel.tensor.huggingface.vit``."""

from dtrain.modelparallel.tensor.huggingface.vit import (  # noqa: F401  (the module is the API)
    get_hf_vit_encoder_hooks,
    translate_hf_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_vit,
    translate_state_dict_to_hf_vit,
)

"""``smdistributed.modelparallel.torch.nn.huggingface.gpt2``: see
``dtrain.modelparallel.tensor.huggingface.gpt2``."""

from dtrain.modelparallel.tensor.huggingface.gpt2 import (  # noqa: F401  (the module is the API)
    get_hf_gpt2_transformer_layer_hooks,
    get_hf_gpt2_transformer_lm_head_hooks,
    translate_hf_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gpt2,
    translate_hf_state_dict_to_smdistributed_gpt2_layer,
    translate_state_dict_to_hf_gpt2,
    translate_state_dict_to_hf_gpt2_layer,
)

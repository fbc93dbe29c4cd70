"""``smdistributed.modelparallel.torch.nn.huggingface.gptneo``: see
``dtrain.modelparallel.tensor.huggingface.gptneo``."""

from dtrain.modelparallel.tensor.huggingface.gptneo import (  # noqa: F401  (the module is the API)
    get_hf_gptneo_transformer_lm_head_hooks,
    translate_hf_gptneo_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gptneo,
    translate_state_dict_to_hf_gptneo,
)

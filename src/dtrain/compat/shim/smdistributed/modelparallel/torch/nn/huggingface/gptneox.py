"""``smdistributed.modelparallel.torch.nn.huggingface.gptneox``: see
``dtrain.modelparallel.tensor.huggingface.gptneox``."""

from dtrain.modelparallel.tensor.huggingface.gptneox import (  # noqa: F401  (the module is the API)
    get_hf_gptneox_transformer_lm_head_hooks,
    translate_hf_gptneox_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gptneox,
    translate_state_dict_to_hf_gptneox,
)

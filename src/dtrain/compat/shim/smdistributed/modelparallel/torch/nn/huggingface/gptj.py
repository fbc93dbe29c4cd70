"""``smdistributed.modelparallel.torch.nn.huggingface.gptj``: see
``dtrain.modelparallel.tensor.huggingface.gptj``."""

from dtrain.modelparallel.tensor.huggingface.gptj import (  # noqa: F401  (the module is the API)
    get_hf_gptj_transformer_hooks,
    translate_hf_gptj_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_gptj,
    translate_state_dict_to_hf_gptj,
)

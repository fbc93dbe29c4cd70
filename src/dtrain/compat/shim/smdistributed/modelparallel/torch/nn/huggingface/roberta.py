"""``smdistributed.modelparallel.torch.nn.huggingface.roberta``: see
``dtrain.modelparallel.tensor.huggingface.roberta``."""

from dtrain.modelparallel.tensor.huggingface.roberta import (  # noqa: F401  (the module is the API)
    get_hf_roberta_transformer_hooks,
    translate_hf_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_roberta,
    translate_state_dict_to_hf_roberta,
)

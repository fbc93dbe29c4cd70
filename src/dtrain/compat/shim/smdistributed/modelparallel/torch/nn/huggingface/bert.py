"""``smdistributed.modelparallel.torch.nn.huggingface.bert``: see
``dtrain.modelparallel.tensor.huggingface.bert``."""

from dtrain.modelparallel.tensor.huggingface.bert import (  # noqa: F401  (the module is the API)
    get_hf_bert_transformer_hooks,
    translate_hf_state_dict_to_smdistributed,
    translate_hf_state_dict_to_smdistributed_bert,
    translate_state_dict_to_hf_bert,
)

"""``smp.nn.huggingface.gptneo``: Hugging Face GPT-Neo models split in place (:mod:`.inplace`).

GPT-Neo's attention (global and local) reshapes with its ``num_heads``, which becomes the rank's
count. ``token_type_ids`` are refused, as for GPT-J (embedded with the word embedding). SMP's
translation functions return their input: the model keeps HF's names.
"""

from dtrain.modelparallel.tensor.huggingface.family import Family
from dtrain.modelparallel.tensor.huggingface.inplace import hooks_refused, in_place, same_names

FAMILY = Family(
    name="gptneo",
    layers="h.*",
    colwise=("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj", "mlp.c_fc"),
    rowwise=("attn.attention.out_proj", "mlp.c_proj"),
    sizes=("num_heads", "intermediate_size"),
    head_counts={"attn.attention": "num_heads"},
    refused_inputs={"token_type_ids": "GPT-Neo embeds them with its word embedding"},
    attention_dropout="attention_dropout",
    dropout_in="attn.attention.attn_dropout",
)

translate_hf_state_dict_to_smdistributed_gptneo = same_names
translate_hf_gptneo_state_dict_to_smdistributed = same_names  # SMP's older name
translate_state_dict_to_hf_gptneo = same_names

get_hf_gptneo_transformer_lm_head_hooks = hooks_refused(
    "smp.nn.huggingface.gptneo.get_hf_gptneo_transformer_lm_head_hooks",
    "GPTNeoForCausalLM as smp.nn.DistributedTransformerLMHead",
    in_place("GPT-Neo"),
)

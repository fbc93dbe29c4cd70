"""``smp.nn.huggingface.gptj``: Hugging Face GPT-J models split in place (:mod:`.inplace`).

GPT-J's attention reshapes with its ``num_attention_heads``, which becomes the rank's count.
``token_type_ids`` are refused: GPT-J embeds them with the word embedding inside the base model,
which would then see the rank's rows and the group's combined batch. SMP's translation
functions return their input: the model keeps HF's names.
"""

from dtrain.modelparallel.tensor.huggingface.inplace import Family, same_names

FAMILY = Family(
    name="gptj",
    layers="h.*",
    colwise=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"),
    rowwise=("attn.out_proj", "mlp.fc_out"),
    sizes=("n_head", "n_inner"),
    head_counts={"attn": "num_attention_heads"},
    refused_inputs={"token_type_ids": "GPT-J embeds them with its word embedding"},
)

translate_hf_state_dict_to_smdistributed_gptj = same_names
translate_hf_gptj_state_dict_to_smdistributed = same_names  # SMP's older name
translate_state_dict_to_hf_gptj = same_names

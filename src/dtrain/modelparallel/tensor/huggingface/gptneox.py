"""``smp.nn.huggingface.gptneox``: Hugging Face GPT-NeoX models split in place
(:mod:`.inplace`).

The fused ``query_key_value`` layer holds each head's query, key and value side by side, so
splitting it by output features gives every rank whole heads; ``dense`` and the feed-forward's
``dense_4h_to_h`` split by input features. The parallel attention + feed-forward residual and
the rotary embeddings run unchanged on the rank's heads. SMP's translation functions return
their input: the model keeps HF's names.
"""

from dtrain.modelparallel.tensor.huggingface.inplace import Family, same_names

FAMILY = Family(
    name="gptneox",
    layers="layers.*",
    colwise=("attention.query_key_value", "mlp.dense_h_to_4h"),
    rowwise=("attention.dense", "mlp.dense_4h_to_h"),
    sizes=("num_attention_heads", "intermediate_size"),
)

translate_hf_state_dict_to_smdistributed_gptneox = same_names
translate_hf_gptneox_state_dict_to_smdistributed = same_names  # SMP's older name
translate_state_dict_to_hf_gptneox = same_names

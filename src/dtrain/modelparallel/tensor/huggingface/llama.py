"""``smp.nn.huggingface.llama``: Hugging Face Llama models split in place (:mod:`.inplace`).

Query, key, value and the gated feed-forward's gate and up projections split by output
features, the output and down projections by input features (HF's own ``base_model_tp_plan``
for Llama). Attention reshapes with ``-1`` heads, and grouped-query attention repeats each
rank's key/value heads by the same ratio, so attention needs no change; the key/value heads
must split too.
"""

from dtrain.modelparallel.tensor.huggingface.family import Family

FAMILY = Family(
    name="llama",
    layers="layers.*",
    colwise=(
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    ),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    sizes=("num_attention_heads", "num_key_value_heads", "intermediate_size"),
    attention_dropout="attention_dropout",
    dropout_in="self_attn",
)

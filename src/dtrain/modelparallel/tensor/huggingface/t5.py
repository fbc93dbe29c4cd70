"""``smp.nn.huggingface.t5``: Hugging Face T5 models split in place (:mod:`.inplace`).

The encoder and the decoder are each a base model of their own (a scaled-batch region): the
shared word embedding runs on the rank's rows before each, and so does the LM head tied to it;
the decoder gathers the encoder's states (the rank's rows) with its other inputs. In every block
the self-attention's (and the decoder's cross-attention's) ``q``, ``k``, ``v`` are split by
output features (heads), ``o`` by input features; the relative position bias of the first
block, an embedding with one column per head, is split by columns, so each rank adds its own
heads' biases; the feed-forward's ``wi`` (gated: ``wi_0`` and ``wi_1``) by output features,
``wo`` by input features. The attention modules' head count (``n_heads``, which sizes the
zero bias of the cross-attention) becomes the rank's.

T5 drops attention probabilities with ``dropout_rate``, its one dropout field, in HF's attention
function: drawn per head (:class:`.inplace.HeadDropout`) with eager attention, refused with the
kernels at tp > 1 (:func:`.inplace.attention_dropout`), and the feed-forward's dropout between
``wi`` and ``wo``, on split features, is drawn for all of them and sliced likewise. SMP 1.12.1
never distributed T5 (its T5 block hooks were disabled for the relative position bias); dtrain
keeps HF's modules and names, so the translation functions return their input and SMP's block
hooks are refused.
"""

from typing import NoReturn

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.huggingface.family import BATCH_INPUTS, Family
from dtrain.modelparallel.tensor.huggingface.inplace import same_names

ATTENTION = ("layer.*.SelfAttention", "layer.*.EncDecAttention")

FAMILY = Family(
    name="t5",
    layers="block.*",
    colwise=(
        *(f"{attention}.{name}" for attention in ATTENTION for name in ("q", "k", "v")),
        "layer.0.SelfAttention.relative_attention_bias",
        "layer.*.DenseReluDense.wi",
        "layer.*.DenseReluDense.wi_0",
        "layer.*.DenseReluDense.wi_1",
    ),
    rowwise=(*(f"{attention}.o" for attention in ATTENTION), "layer.*.DenseReluDense.wo"),
    sizes=("num_heads", "d_ff"),
    head_counts=dict.fromkeys(ATTENTION, "n_heads"),
    attention_dropout="dropout_rate",
    dropout_in="layer.*.*Attention",
    split_dropout=("layer.*.DenseReluDense", "dropout_rate"),
    bases=("encoder", "decoder"),
    inputs=(*BATCH_INPUTS, "encoder_hidden_states", "encoder_attention_mask"),
)

translate_hf_state_dict_to_smdistributed = same_names
translate_state_dict_to_hf_t5 = same_names


def get_hf_t5_transformer_layer_hooks() -> NoReturn:
    """SMP's hooks for swapping a ``T5Block`` for a ``DistributedTransformerLayer``: refused."""
    raise ModelParallelError(
        "smp.nn.huggingface.t5.get_hf_t5_transformer_layer_hooks: T5 blocks as "
        "smp.nn.DistributedTransformerLayer are not supported by dtrain (it has no cross "
        "attention or relative position bias); create the whole T5 model inside "
        "smp.tensor_parallelism() or mark it with smp.set_tensor_parallelism, and it is split "
        "in place"
    )

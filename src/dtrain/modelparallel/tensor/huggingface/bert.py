"""``smp.nn.huggingface.bert``: Hugging Face BERT models split in place (:mod:`.inplace`).

Every encoder layer's query, key, value and intermediate layer split by output features, its
attention output and output layers by input features (SMP's BERT distributes the encoder
alike). The word embedding, tied to a masked-LM decoder, runs on the rank's rows; position and
token type embeddings, the encoder and the pooler on the group's combined batch. Cross
attention (``add_cross_attention``) is refused. SMP's translation functions return their
input: the model keeps HF's names.
"""

from typing import Any

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.huggingface.family import Family
from dtrain.modelparallel.tensor.huggingface.inplace import hooks_refused, in_place, same_names


def refuse_cross_attention(config: Any) -> None:
    """Encoder-decoder attention would need the encoder's states gathered too."""
    if getattr(config, "add_cross_attention", False):
        raise ModelParallelError(
            f"smp.nn.huggingface.{config.model_type}: add_cross_attention=True is not supported "
            "with tensor parallelism; allowed: False"
        )


FAMILY = Family(
    name="bert",
    layers="encoder.layer.*",
    colwise=(
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "intermediate.dense",
    ),
    rowwise=("attention.output.dense", "output.dense"),
    sizes=("num_attention_heads", "intermediate_size"),
    check=refuse_cross_attention,
    attention_dropout="attention_probs_dropout_prob",
    dropout_in="attention.self",
)

translate_hf_state_dict_to_smdistributed = same_names
translate_state_dict_to_hf_bert = same_names
translate_hf_state_dict_to_smdistributed_bert = same_names

get_hf_bert_transformer_hooks = hooks_refused(
    "smp.nn.huggingface.bert.get_hf_bert_transformer_hooks",
    "BertEncoder as smp.nn.DistributedTransformer",
    in_place("BERT"),
)

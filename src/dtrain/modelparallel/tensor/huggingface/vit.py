"""``smp.nn.huggingface.vit``: Hugging Face ViT models split in place (:mod:`.inplace`).

Every layer's ``q_proj``, ``k_proj``, ``v_proj`` and ``mlp.fc1`` split by output features, its
``o_proj`` and ``mlp.fc2`` by input features. ViT embeds pixels, not ids: the whole ``ViTModel``
(patch and position embeddings, the class token, the layers, the final norm, a pooler) is the
scaled-batch region, the images gathered over the tp group; the classifier and the loss run on
the rank's rows. SMP's translation functions return their input (the model keeps HF's names),
and SMP's encoder hooks are refused. Created without memory it is refused (its ``trunc_normal_``
initialisation cannot be deferred, :mod:`dtrain.modelparallel.deferred`).
"""

from typing import NoReturn

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.huggingface.family import Family
from dtrain.modelparallel.tensor.huggingface.inplace import same_names

FAMILY = Family(
    name="vit",
    layers="layers.*",
    colwise=("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
    rowwise=("attention.o_proj", "mlp.fc2"),
    sizes=("num_attention_heads", "intermediate_size"),
    head_counts={"attention": "num_attention_heads"},
    attention_dropout="attention_probs_dropout_prob",
    dropout_in="attention",
    inputs=("pixel_values", "bool_masked_pos", "attention_mask"),
    word_embedding=False,
)

translate_hf_state_dict_to_smdistributed_vit = same_names
translate_hf_state_dict_to_smdistributed = same_names
translate_state_dict_to_hf_vit = same_names


def get_hf_vit_encoder_hooks() -> NoReturn:
    """SMP's hooks for swapping HF's ``ViTEncoder`` for a ``DistributedTransformer``: refused."""
    raise ModelParallelError(
        "smp.nn.huggingface.vit.get_hf_vit_encoder_hooks: ViT's encoder as "
        "smp.nn.DistributedTransformer is not supported by dtrain (transformers 5 has no "
        "ViTEncoder); create the whole ViT model inside smp.tensor_parallelism() or mark it "
        "with smp.set_tensor_parallelism, and it is split in place"
    )

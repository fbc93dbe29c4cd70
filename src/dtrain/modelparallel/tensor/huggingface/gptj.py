"""``smp.nn.huggingface.gptj``: Hugging Face GPT-J, two ways (as :mod:`.gptneox`).

* **SMP's translation** (:data:`REGISTRATION`): a ``GPTJForCausalLM`` marked with
  ``zero_init=False`` becomes a
  :class:`~dtrain.modelparallel.tensor.transformer.DistributedTransformerLMHead`: rotary
  attention on ``rotary_dim`` dimensions of each head (neighbouring pairs), attention and
  feed-forward in parallel through one layer norm, projections without biases, a head with a
  bias, ``ln_f`` as the last layer's norm after its output; weights translated by name.
* **In place** (:data:`FAMILY`, :mod:`.inplace`): otherwise the model keeps HF's modules;
  GPT-J's attention reshapes with its ``num_attention_heads``, which becomes the rank's count.
  ``token_type_ids`` are refused: GPT-J embeds them with the word embedding inside the base
  model, which would then see the rank's rows and the group's combined batch.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.huggingface import causal
from dtrain.modelparallel.tensor.huggingface.family import Family
from dtrain.modelparallel.tensor.marks import Args

WHAT = "smp.nn.huggingface.gptj"

FAMILY = Family(
    name="gptj",
    layers="h.*",
    colwise=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"),
    rowwise=("attn.out_proj", "mlp.fc_out"),
    sizes=("n_head", "n_inner"),
    head_counts={"attn": "num_attention_heads"},
    refused_inputs={"token_type_ids": "GPT-J embeds them with its word embedding"},
    attention_dropout="attn_pdrop",
    dropout_in="attn.attn_dropout",
)

ACTIVATIONS = {"gelu_new": "gelu_new", "gelu": "gelu", "relu": "relu"}
"""GPT-J's activations and the output layer's names for them."""


def init_hook(config: Any) -> Args:
    """The LM head's arguments for a ``GPTJConfig``."""
    if config.n_embd % config.n_head:
        raise ModelParallelError(
            f"{WHAT}: n_embd={config.n_embd} is not a multiple of n_head={config.n_head}"
        )
    if config.activation_function not in ACTIVATIONS:
        raise ModelParallelError(
            f"{WHAT}: activation_function={config.activation_function!r}; allowed: "
            f"{', '.join(ACTIVATIONS)}"
        )
    head_size = config.n_embd // config.n_head
    return (), {
        "num_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "attention_head_size": head_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.n_inner or 4 * config.n_embd,
        "vocab_size": config.vocab_size,
        "num_positions": config.n_positions,
        "causal_mask_size": config.n_positions,
        "rotary_dim": config.rotary_dim or head_size,
        "parallel_attn_output": True,
        "single_pre_layernorm": True,
        "use_qkv_bias": False,
        "use_attn_dense_bias": False,
        "use_lm_head_bias": True,
        "attention_dropout_prob": config.attn_pdrop,
        "hidden_dropout_prob": config.resid_pdrop,
        "embedding_dropout_prob": config.embd_pdrop,
        "tie_word_embeddings": config.tie_word_embeddings,
        "activation": ACTIVATIONS[config.activation_function],
        "layernorm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        **causal.COMMON,
    }


args_of = causal.args_of

NAMES: causal.Names = (
    ("lm_head", "lm_head"),
    ("transformer.wte", "word_embedding"),
    ("transformer.ln_f", "transformer.seq_layers.{last}.output.layernorm"),
    ("transformer.h.{n}.ln_1", "transformer.seq_layers.{n}.attention.pre_layernorm"),
    ("transformer.h.{n}.attn.q_proj", "transformer.seq_layers.{n}.attention.query"),
    ("transformer.h.{n}.attn.k_proj", "transformer.seq_layers.{n}.attention.key"),
    ("transformer.h.{n}.attn.v_proj", "transformer.seq_layers.{n}.attention.value"),
    ("transformer.h.{n}.attn.out_proj", "transformer.seq_layers.{n}.attention.dense"),
    ("transformer.h.{n}.mlp.fc_in", "transformer.seq_layers.{n}.output.dense1"),
    ("transformer.h.{n}.mlp.fc_out", "transformer.seq_layers.{n}.output.dense2"),
)
"""``GPTJForCausalLM``'s modules → the distributed LM head's."""

_BUFFERS = (".attn.bias", ".attn.masked_bias", ".attn.embed_positions")
"""Older transformers' causal masks and rotary tables in a block's state dict."""


def translate_hf_state_dict_to_smdistributed_gptj(
    state_dict: dict[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """A ``GPTJForCausalLM`` state dict under the distributed LM head's names (``max_seq_len``,
    which SMP's older name takes, is not needed)."""
    del max_seq_len
    return causal.rename(WHAT, state_dict, NAMES, "transformer.h.", skipped=_BUFFERS)


def translate_state_dict_to_hf_gptj(
    state_dict: dict[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """The distributed LM head's state dict under ``GPTJForCausalLM``'s names."""
    del max_seq_len
    back = tuple((mine, theirs) for theirs, mine in NAMES)
    return causal.rename(WHAT, state_dict, back, "transformer.seq_layers.")


translate_hf_gptj_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptj
"""SMP's older name."""


def translations(config: Any) -> causal.Translations:
    """The state-dict translations to HF's names and from them (a checkpoint's)."""
    del config
    return translate_state_dict_to_hf_gptj, translate_hf_state_dict_to_smdistributed_gptj


REGISTRATION = causal.registration(WHAT, init_hook)


def get_hf_gptj_transformer_hooks() -> tuple[Any, Any, Any]:
    """SMP's hooks turning a ``GPTJForCausalLM`` into the distributed LM head (init, forward,
    return)."""
    return causal.hooks_of(REGISTRATION)

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
from dtrain.modelparallel.tensor.huggingface.inplace import Family
from dtrain.modelparallel.tensor.marks import Args, Registration
from dtrain.modelparallel.tensor.transformer import DistributedTransformerLMHead

WHAT = "smp.nn.huggingface.gptj"

FAMILY = Family(
    name="gptj",
    layers="h.*",
    colwise=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"),
    rowwise=("attn.out_proj", "mlp.fc_out"),
    sizes=("n_head", "n_inner"),
    head_counts={"attn": "num_attention_heads"},
    refused_inputs={"token_type_ids": "GPT-J embeds them with its word embedding"},
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
        "use_positional_embedding": False,
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
        "use_normal_initialization": True,
        "pre_layernorm": True,
        "post_layernorm": True,
    }


def forward_hook(*args: Any, **kwargs: Any) -> Args:
    return causal.forward_inputs(WHAT, *args, **kwargs)


return_hook = causal.output
args_of = causal.args_of

_BLOCK = {
    "ln_1": "attention.pre_layernorm",
    "attn.q_proj": "attention.query",
    "attn.k_proj": "attention.key",
    "attn.v_proj": "attention.value",
    "attn.out_proj": "attention.dense",
    "mlp.fc_in": "output.dense1",
    "mlp.fc_out": "output.dense2",
}
"""A GPT-J block's modules → the distributed layer's."""

_BUFFERS = ("attn.bias", "attn.masked_bias", "attn.embed_positions")
"""Older transformers' causal masks and rotary tables in a block's state dict."""


def translate_hf_state_dict_to_smdistributed_gptj(
    state_dict: dict[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """A ``GPTJForCausalLM`` state dict under the distributed LM head's names (``max_seq_len``,
    which SMP's older name takes, is not needed)."""
    del max_seq_len
    last = causal.layer_count(state_dict, "transformer.h.") - 1
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        kind, name = parts[-1], ".".join(parts[3:-1])
        if parts[0] == "lm_head":
            out[key] = value
        elif parts[:2] == ["transformer", "wte"]:
            out[f"word_embedding.{kind}"] = value
        elif parts[:2] == ["transformer", "ln_f"]:
            out[f"transformer.seq_layers.{last}.output.layernorm.{kind}"] = value
        elif parts[:2] == ["transformer", "h"] and name in _BUFFERS:
            continue
        elif parts[:2] == ["transformer", "h"] and name in _BLOCK:
            out[f"transformer.seq_layers.{parts[2]}.{_BLOCK[name]}.{kind}"] = value
        else:
            raise ModelParallelError(f"{WHAT}: unknown key {key!r}")
    return out


def translate_state_dict_to_hf_gptj(
    state_dict: dict[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """The distributed LM head's state dict under ``GPTJForCausalLM``'s names."""
    del max_seq_len
    last = str(causal.layer_count(state_dict, "transformer.seq_layers.") - 1)
    block = {mine: theirs for theirs, mine in _BLOCK.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        kind, name = parts[-1], ".".join(parts[3:-1])
        if parts[0] == "lm_head":
            out[key] = value
        elif parts[0] == "word_embedding":
            out[f"transformer.wte.{kind}"] = value
        elif parts[:2] != ["transformer", "seq_layers"]:
            raise ModelParallelError(f"{WHAT}: unknown key {key!r}")
        elif name == "output.layernorm" and parts[2] == last:
            out[f"transformer.ln_f.{kind}"] = value
        elif name in block:
            out[f"transformer.h.{parts[2]}.{block[name]}.{kind}"] = value
        else:
            raise ModelParallelError(f"{WHAT}: unknown key {key!r}")
    return out


translate_hf_gptj_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptj
"""SMP's older name."""

REGISTRATION = Registration(
    DistributedTransformerLMHead,
    init_hook=init_hook,
    forward_hook=forward_hook,
    return_hook=return_hook,
    translate=translate_hf_state_dict_to_smdistributed_gptj,
)

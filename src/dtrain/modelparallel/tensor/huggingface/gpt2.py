"""``smp.nn.huggingface.gpt2``: Hugging Face's ``GPT2LMHeadModel`` as a
:class:`~dtrain.modelparallel.tensor.transformer.DistributedTransformerLMHead`.

A ``GPT2LMHeadModel`` created inside ``smp.tensor_parallelism()`` (or marked with
``smp.set_tensor_parallelism``) becomes, when the model is wrapped, a distributed LM head built
from its config, with its weights translated: GPT-2's ``Conv1D`` layers hold ``[in, out]``
weights (``nn.Linear``: ``[out, in]``), its fused ``c_attn`` is split into query, key and value,
and ``ln_f`` is the last layer's norm after its output. The config's dropouts (``embd_pdrop``
too), ``tie_word_embeddings`` and attention scaling (``scale_attn_weights``,
``scale_attn_by_inverse_layer_idx``) are honoured; ``reorder_and_upcast_attn=True`` (a
half-precision kernel choice) is refused. The model is then called as the HF
model (keywords) and returns a ``CausalLMOutputWithCrossAttentions`` (loss and logits). The two
``translate_*`` functions (SMP's names) turn state dicts either way, so a distributed model's
checkpoint loads into the plain HF model and back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.huggingface import causal
from dtrain.modelparallel.tensor.huggingface.causal import Translations
from dtrain.modelparallel.tensor.huggingface.inplace import hooks_refused
from dtrain.modelparallel.tensor.marks import Args, Registration
from dtrain.modelparallel.tensor.transformer import DistributedTransformerLMHead

CLASS = "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
"""The class this module distributes, by its qualified name (``transformers`` stays unimported
until a model of it is seen)."""

ACTIVATIONS = {"gelu_new": "gelu_new", "relu": "relu"}
"""GPT-2's activations and the output layer's names for them (SMP maps ``gelu_new`` to its exact
``gelu``; dtrain keeps GPT-2's tanh approximation, so the model trains as the HF one does)."""

_UNSUPPORTED_INPUTS = (
    "past_key_values",
    "inputs_embeds",
    "encoder_hidden_states",
    "encoder_attention_mask",
    "head_mask",
    "output_attentions",
    "output_hidden_states",
)


def init_hook(config: Any) -> Args:
    """The LM head's arguments for a ``GPT2Config``."""
    if config.n_embd % config.n_head:
        raise ModelParallelError(
            f"smp.nn.huggingface.gpt2: n_embd={config.n_embd} is not a multiple of "
            f"n_head={config.n_head}"
        )
    if getattr(config, "reorder_and_upcast_attn", False):
        raise ModelParallelError(
            "smp.nn.huggingface.gpt2: reorder_and_upcast_attn=True is not supported by dtrain; "
            "allowed: False"
        )
    if config.activation_function not in ACTIVATIONS:
        raise ModelParallelError(
            f"smp.nn.huggingface.gpt2: activation_function={config.activation_function!r}; "
            f"allowed: {', '.join(ACTIVATIONS)}"
        )
    return (), {
        "num_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "attention_head_size": config.n_embd // config.n_head,
        "hidden_size": config.n_embd,
        "intermediate_size": config.n_inner or 4 * config.n_embd,
        "vocab_size": config.vocab_size,
        "num_positions": config.n_positions,
        "attention_dropout_prob": config.attn_pdrop,
        "hidden_dropout_prob": config.resid_pdrop,
        "embedding_dropout_prob": config.embd_pdrop,
        "tie_word_embeddings": config.tie_word_embeddings,
        "scale_attention_scores": config.scale_attn_weights,
        "scale_attn_by_layer_idx": config.scale_attn_by_inverse_layer_idx,
        "activation": ACTIVATIONS[config.activation_function],
        "layernorm_epsilon": config.layer_norm_epsilon,
        "add_cross_attention": config.add_cross_attention,
        "initializer_range": config.initializer_range,
        "use_normal_initialization": True,
        "pre_layernorm": True,
        "post_layernorm": True,
        "causal_mask_size": config.n_positions,
    }


def forward_hook(
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    return_dict: bool | None = None,
    **others: Any,
) -> Args:
    """HF's keyword inputs → the LM head's input tuple; what it cannot honour is refused."""
    given = sorted(name for name in _UNSUPPORTED_INPUTS if others.pop(name, None))
    if given or others:
        raise ModelParallelError(
            f"smp.nn.huggingface.gpt2: the distributed GPT-2 does not take {given + sorted(others)}"
        )
    if return_dict is False:
        raise ModelParallelError("smp.nn.huggingface.gpt2: return_dict=False is not supported")
    return ((input_ids, attention_mask, token_type_ids, position_ids, labels),), {}


def return_hook(outputs: Any) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    loss, logits = outputs if isinstance(outputs, tuple) else (None, outputs)
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)


def args_of(model: nn.Module) -> Args:
    return (model.config,), {}


def _last_layer(state_dict: dict[str, Any]) -> int:
    layers = [int(key.split(".")[2]) for key in state_dict if key.startswith("transformer.h.")]
    return max(layers, default=-1)


def translate_hf_state_dict_to_smdistributed(
    state_dict: dict[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` state dict under the distributed LM head's names (``max_seq_len``,
    SMP's argument, is not needed)."""
    del max_seq_len
    last = _last_layer(state_dict)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        kind = parts[-1]
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal masks of older transformers
        if parts[0] == "lm_head":
            out[key] = value
        elif parts[:2] == ["transformer", "wte"]:
            out[f"word_embedding.{kind}"] = value
        elif parts[:2] == ["transformer", "wpe"]:
            out[f"position_embedding.{kind}"] = value
        elif parts[:2] == ["transformer", "ln_f"]:
            out[f"transformer.seq_layers.{last}.output.layernorm.{kind}"] = value
        elif parts[:2] == ["transformer", "h"]:
            out.update(_from_block(f"transformer.seq_layers.{parts[2]}", parts[3:], value))
        else:
            raise ModelParallelError(f"smp.nn.huggingface.gpt2: unknown key {key!r}")
    return out


def _from_block(prefix: str, parts: list[str], value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One parameter of block ``prefix`` (``ln_1.weight``, ``attn.c_attn.bias``, ...)."""
    kind = parts[-1]
    value_t = value.t() if kind == "weight" else value  # Conv1D: [in, out]
    name = ".".join(parts[:-1])
    if name == "ln_1":
        return {f"{prefix}.attention.pre_layernorm.{kind}": value}
    if name == "ln_2":
        return {f"{prefix}.output.pre_layernorm.{kind}": value}
    if name == "attn.c_attn":
        q, k, v = value_t.chunk(3, dim=0)
        return {
            f"{prefix}.attention.{n}.{kind}": t
            for n, t in zip(("query", "key", "value"), (q, k, v), strict=True)
        }
    simple = {
        "attn.c_proj": "attention.dense",
        "mlp.c_fc": "output.dense1",
        "mlp.c_proj": "output.dense2",
    }
    if name in simple:
        return {f"{prefix}.{simple[name]}.{kind}": value_t}
    raise ModelParallelError(f"smp.nn.huggingface.gpt2: unknown block parameter {name}.{kind}")


def translate_state_dict_to_hf_gpt2(
    state_dict: dict[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """The distributed LM head's state dict under ``GPT2LMHeadModel``'s names."""
    del max_seq_len
    layers = [key.split(".")[2] for key in state_dict if key.startswith("transformer.seq_layers.")]
    last = str(max((int(n) for n in layers), default=-1))
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        kind = parts[-1]
        if parts[0] == "lm_head":
            out[key] = value
        elif parts[0] == "word_embedding":
            out[f"transformer.wte.{kind}"] = value
        elif parts[0] == "position_embedding":
            out[f"transformer.wpe.{kind}"] = value
        elif parts[:2] == ["transformer", "seq_layers"]:
            layer, name = parts[2], ".".join(parts[3:-1])
            prefix = f"transformer.h.{layer}"
            value_t = value.t() if kind == "weight" else value
            if name in ("attention.query", "attention.key", "attention.value"):
                qkv.setdefault(f"{prefix}.attn.c_attn.{kind}", {})[name] = value_t
            elif name == "output.layernorm" and layer == last:
                out[f"transformer.ln_f.{kind}"] = value
            else:
                out[_block_key(prefix, name, kind)] = value if "layernorm" in name else value_t
        else:
            raise ModelParallelError(f"smp.nn.huggingface.gpt2: unknown key {key!r}")
    for key, parts_of in qkv.items():
        order = [parts_of[f"attention.{n}"] for n in ("query", "key", "value")]
        out[key] = torch.cat(order, dim=-1 if key.endswith("weight") else 0)
    return out


def _block_key(prefix: str, name: str, kind: str) -> str:
    names = {
        "attention.pre_layernorm": "ln_1",
        "output.pre_layernorm": "ln_2",
        "attention.dense": "attn.c_proj",
        "output.dense1": "mlp.c_fc",
        "output.dense2": "mlp.c_proj",
    }
    if name not in names:
        raise ModelParallelError(f"smp.nn.huggingface.gpt2: unknown parameter {name}.{kind}")
    return f"{prefix}.{names[name]}.{kind}"


def translations(config: Any) -> Translations:
    """The state-dict translations to HF's names and from them (a checkpoint's)."""
    del config
    return translate_state_dict_to_hf_gpt2, translate_hf_state_dict_to_smdistributed


REGISTRATION = Registration(
    DistributedTransformerLMHead,
    init_hook=init_hook,
    forward_hook=forward_hook,
    return_hook=return_hook,
)


translate_hf_state_dict_to_smdistributed_gpt2 = translate_hf_state_dict_to_smdistributed
"""The name later SMP versions give it, which AWS's ``train_gpt_simple.py`` imports."""

LAYER = "transformer.h.0."
"""A ``GPT2Block``'s keys as the first layer of a model (its translations go through the
model's)."""


def translate_hf_state_dict_to_smdistributed_gpt2_layer(
    state_dict: dict[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """A ``GPT2Block`` state dict under ``DistributedTransformerLayer``'s names."""
    whole = translate_hf_state_dict_to_smdistributed(
        {LAYER + key: value for key, value in state_dict.items()}, max_seq_len
    )
    return _unprefixed(whole, "transformer.seq_layers.0.")


def translate_state_dict_to_hf_gpt2_layer(
    state_dict: dict[str, torch.Tensor], max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """A ``DistributedTransformerLayer`` state dict (pre-layer-norm, as a ``GPT2Block``
    translates) under ``GPT2Block``'s names."""
    whole = translate_state_dict_to_hf_gpt2(
        {f"transformer.seq_layers.0.{key}": value for key, value in state_dict.items()},
        max_seq_len,
    )
    return _unprefixed(whole, LAYER)


def _unprefixed(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A translated layer's keys without the model's ``prefix``; a key outside it (a layer norm
    after the output, which a model takes as its final norm) fails, naming it."""
    outside = sorted(key for key in state_dict if not key.startswith(prefix))
    if outside:
        raise ModelParallelError(
            f"smp.nn.huggingface.gpt2: a GPT-2 layer has no {outside} (translated from a layer "
            "with post_layernorm?); allowed: a pre-layer-norm layer's keys"
        )
    return {key.removeprefix(prefix): value for key, value in state_dict.items()}


def get_hf_gpt2_transformer_lm_head_hooks() -> tuple[Any, Any, Any]:
    """SMP's hooks turning a ``GPT2LMHeadModel`` into the distributed LM head (init, forward,
    return)."""
    return causal.hooks_of(REGISTRATION)


get_hf_gpt2_transformer_layer_hooks = hooks_refused(
    "smp.nn.huggingface.gpt2.get_hf_gpt2_transformer_layer_hooks",
    "GPT2Block as smp.nn.DistributedTransformerLayer",
    "create the whole GPT2LMHeadModel inside smp.tensor_parallelism() or mark it with "
    "smp.set_tensor_parallelism, and it becomes an smp.nn.DistributedTransformerLMHead",
)

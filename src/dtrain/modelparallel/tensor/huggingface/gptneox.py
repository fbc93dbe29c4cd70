"""``smp.nn.huggingface.gptneox``: Hugging Face GPT-NeoX, two ways.

* **SMP's translation** (:data:`REGISTRATION`): a ``GPTNeoXForCausalLM`` marked with SMP's
  distributed-transformer intent (``zero_init=False`` among its marking options, as AWS's
  GPT-NeoX script passes with its default ``use_distributed_transformer=1``) becomes a
  :class:`~dtrain.modelparallel.tensor.transformer.DistributedTransformerLMHead` when the model
  is wrapped: rotary attention on ``rotary_pct`` of each head (NeoX's halves), the parallel
  residual when ``use_parallel_residual``, no position table, an untied head unless
  ``tie_word_embeddings``, ``final_layer_norm`` as the last layer's norm after its output. Its
  weights are translated: the fused ``query_key_value``, which holds each head's query, key and
  value rows side by side, becomes ``query``/``key``/``value``. It is called as the HF model
  (keywords) and returns a ``CausalLMOutputWithPast`` (loss and logits).
* **In place** (:data:`FAMILY`, :mod:`.inplace`): otherwise the model keeps HF's modules and
  names; splitting ``query_key_value`` by output features gives every rank whole heads.

The two ``translate_*`` functions (SMP's names) turn state dicts either way; they need the head
count, which ``num_attention_heads`` names or the one config translated since the last
``smp.reset`` gives (as SMP's do); without either they fail.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.huggingface import causal
from dtrain.modelparallel.tensor.huggingface.family import Family
from dtrain.modelparallel.tensor.marks import Args

WHAT = "smp.nn.huggingface.gptneox"

FAMILY = Family(
    name="gptneox",
    layers="layers.*",
    colwise=("attention.query_key_value", "mlp.dense_h_to_4h"),
    rowwise=("attention.dense", "mlp.dense_4h_to_h"),
    sizes=("num_attention_heads", "intermediate_size"),
    attention_dropout="attention_dropout",
    dropout_in="attention",
)

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu"}
"""GPT-NeoX's activations and the output layer's names for them (exact ``gelu`` stays exact)."""

_heads: set[int] = set()
"""The head counts of the configs :func:`init_hook` translated since the last reset (SMP's
translation functions take only the state dict): one is the translation's, several leave it
unknown."""

state.on_reset(_heads.clear)


def _rope(config: Any) -> tuple[float, float]:
    """``(base, fraction of each head rotated)`` of a config, old fields or ``rope_parameters``."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise ModelParallelError(f"{WHAT}: rope_type={kind!r} is not supported; allowed: 'default'")
    base = rope.get("rope_theta", getattr(config, "rotary_emb_base", 10000))
    return float(base), float(rope.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0)))


def init_hook(config: Any) -> Args:
    """The LM head's arguments for a ``GPTNeoXConfig``."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    if hidden % heads:
        raise ModelParallelError(
            f"{WHAT}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
        )
    if config.hidden_act not in ACTIVATIONS:
        raise ModelParallelError(
            f"{WHAT}: hidden_act={config.hidden_act!r}; allowed: {', '.join(ACTIVATIONS)}"
        )
    if not getattr(config, "attention_bias", True):
        raise ModelParallelError(f"{WHAT}: attention_bias=False is not supported; allowed: True")
    base, fraction = _rope(config)
    head_size = hidden // heads
    _heads.add(heads)
    return (), {
        "num_layers": config.num_hidden_layers,
        "num_attention_heads": heads,
        "attention_head_size": head_size,
        "hidden_size": hidden,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "num_positions": config.max_position_embeddings,
        "causal_mask_size": config.max_position_embeddings,
        "rotary_dim": int(head_size * fraction),
        "rotary_emb_base": base,
        "gpt_neox_type_rotary": True,
        "parallel_attn_output": config.use_parallel_residual,
        "attention_dropout_prob": getattr(config, "attention_dropout", 0.0),
        "hidden_dropout_prob": getattr(config, "hidden_dropout", 0.0),
        "embedding_dropout_prob": getattr(config, "hidden_dropout", 0.0),
        "tie_word_embeddings": config.tie_word_embeddings,
        "activation": ACTIVATIONS[config.hidden_act],
        "layernorm_epsilon": config.layer_norm_eps,
        "initializer_range": config.initializer_range,
        **causal.COMMON,
    }


args_of = causal.args_of

NAMES: causal.Names = (
    ("lm_head", "lm_head"),
    ("embed_out", "lm_head"),  # older transformers' name; back, the first pair wins
    ("gpt_neox.embed_in", "word_embedding"),
    ("gpt_neox.final_layer_norm", "transformer.seq_layers.{last}.output.layernorm"),
    ("gpt_neox.layers.{n}.input_layernorm", "transformer.seq_layers.{n}.attention.pre_layernorm"),
    (
        "gpt_neox.layers.{n}.post_attention_layernorm",
        "transformer.seq_layers.{n}.output.pre_layernorm",
    ),
    ("gpt_neox.layers.{n}.attention.dense", "transformer.seq_layers.{n}.attention.dense"),
    ("gpt_neox.layers.{n}.mlp.dense_h_to_4h", "transformer.seq_layers.{n}.output.dense1"),
    ("gpt_neox.layers.{n}.mlp.dense_4h_to_h", "transformer.seq_layers.{n}.output.dense2"),
)
"""``GPTNeoXForCausalLM``'s modules → the distributed LM head's (``query_key_value`` apart)."""

_BUFFERS = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")
"""Older transformers' causal masks and rotary frequencies in a layer's state dict."""

_QKV = ("query", "key", "value")
_FUSED = re.compile(r"gpt_neox\.layers\.(\d+)\.attention\.query_key_value\.(\w+)")
_SPLIT = re.compile(r"transformer\.seq_layers\.(\d+)\.attention\.(query|key|value)\.(\w+)")


def _head_count(num_attention_heads: int | None) -> int:
    """The head count a translation splits ``query_key_value`` by: another one would reshape
    it just as well, into wrong query, key and value weights, so a guess is refused."""
    if num_attention_heads is not None:
        return num_attention_heads
    if len(_heads) != 1:
        known = (
            f"several GPT-NeoX configs were translated ({', '.join(map(str, sorted(_heads)))} "
            "heads)"
            if _heads
            else "no GPT-NeoX config was translated since smp.init or smp.reset"
        )
        raise ModelParallelError(
            f"{WHAT}: the head count is unknown: {known}; pass num_attention_heads"
        )
    return next(iter(_heads))


def translate_hf_state_dict_to_smdistributed_gptneox(
    state_dict: dict[str, torch.Tensor],
    max_seq_len: int | None = None,
    num_attention_heads: int | None = None,
) -> dict[str, torch.Tensor]:
    """A ``GPTNeoXForCausalLM`` state dict under the distributed LM head's names
    (``max_seq_len``, which SMP's older name takes, is not needed)."""
    del max_seq_len
    heads = _head_count(num_attention_heads)
    rest = dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        fused = _FUSED.fullmatch(key)
        if fused:
            del rest[key]
            layer, kind = fused.groups()
            per_head = value.view(heads, 3, -1, *value.shape[1:])  # each head's q, k, v rows
            for i, part in enumerate(_QKV):
                whole = per_head[:, i].reshape(-1, *value.shape[1:])
                out[f"transformer.seq_layers.{layer}.attention.{part}.{kind}"] = whole
    return out | causal.rename(WHAT, rest, NAMES, "gpt_neox.layers.", skipped=_BUFFERS)


def translate_state_dict_to_hf_gptneox(
    state_dict: dict[str, torch.Tensor],
    max_seq_len: int | None = None,
    num_attention_heads: int | None = None,
) -> dict[str, torch.Tensor]:
    """The distributed LM head's state dict under ``GPTNeoXForCausalLM``'s names
    (``max_seq_len``, SMP's argument for causal-mask buffers HF no longer keeps, is not
    needed)."""
    del max_seq_len
    heads = _head_count(num_attention_heads)
    rest = dict(state_dict)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        split = _SPLIT.fullmatch(key)
        if split:
            del rest[key]
            layer, part, kind = split.groups()
            fused = f"gpt_neox.layers.{layer}.attention.query_key_value.{kind}"
            parts.setdefault(fused, {})[part] = value.view(heads, -1, *value.shape[1:])
    back = tuple((mine, theirs) for theirs, mine in NAMES)
    out = causal.rename(WHAT, rest, back, "transformer.seq_layers.")
    for key, of in parts.items():
        out[key] = torch.stack([of[part] for part in _QKV], dim=1).flatten(0, 2)
    return out


translate_hf_gptneox_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptneox
"""SMP's older name, which takes ``max_seq_len`` too."""


def translations(config: Any) -> causal.Translations:
    """The state-dict translations to HF's names and from them (a checkpoint's), by the head
    count of the model's own config, whatever other configs were translated."""
    heads = {"num_attention_heads": config.num_attention_heads}
    return (
        functools.partial(translate_state_dict_to_hf_gptneox, **heads),
        functools.partial(translate_hf_state_dict_to_smdistributed_gptneox, **heads),
    )


REGISTRATION = causal.registration(WHAT, init_hook)


def get_hf_gptneox_transformer_lm_head_hooks() -> tuple[Any, Any, Any]:
    """SMP's hooks turning a ``GPTNeoXForCausalLM`` into the distributed LM head (init, forward,
    return)."""
    return causal.hooks_of(REGISTRATION)

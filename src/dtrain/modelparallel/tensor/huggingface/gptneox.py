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
count, which the last translated config gives (as SMP's do) or ``num_attention_heads`` names.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.huggingface import causal
from dtrain.modelparallel.tensor.huggingface.inplace import Family
from dtrain.modelparallel.tensor.marks import Args, Registration
from dtrain.modelparallel.tensor.transformer import DistributedTransformerLMHead

WHAT = "smp.nn.huggingface.gptneox"

FAMILY = Family(
    name="gptneox",
    layers="layers.*",
    colwise=("attention.query_key_value", "mlp.dense_h_to_4h"),
    rowwise=("attention.dense", "mlp.dense_4h_to_h"),
    sizes=("num_attention_heads", "intermediate_size"),
)

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu"}
"""GPT-NeoX's activations and the output layer's names for them (exact ``gelu`` stays exact)."""

_heads: list[int] = []
"""The head count of the last config :func:`init_hook` translated (SMP's translation functions
take only the state dict)."""


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
    _heads[:] = [heads]
    return (), {
        "num_layers": config.num_hidden_layers,
        "num_attention_heads": heads,
        "attention_head_size": head_size,
        "hidden_size": hidden,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "num_positions": config.max_position_embeddings,
        "causal_mask_size": config.max_position_embeddings,
        "use_positional_embedding": False,
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
        "use_normal_initialization": True,
        "pre_layernorm": True,
        "post_layernorm": True,
    }


def forward_hook(*args: Any, **kwargs: Any) -> Args:
    return causal.forward_inputs(WHAT, *args, **kwargs)


return_hook = causal.output
args_of = causal.args_of


_BLOCK = {
    "input_layernorm": "attention.pre_layernorm",
    "post_attention_layernorm": "output.pre_layernorm",
    "attention.dense": "attention.dense",
    "mlp.dense_h_to_4h": "output.dense1",
    "mlp.dense_4h_to_h": "output.dense2",
}
"""A GPT-NeoX layer's modules → the distributed layer's (``query_key_value`` apart)."""

_QKV = ("query", "key", "value")


def _head_count(num_attention_heads: int | None) -> int:
    if num_attention_heads is not None:
        return num_attention_heads
    if not _heads:
        raise ModelParallelError(
            f"{WHAT}: the head count is unknown (no GPT-NeoX config translated yet); pass "
            "num_attention_heads"
        )
    return _heads[0]


def translate_hf_state_dict_to_smdistributed_gptneox(
    state_dict: dict[str, torch.Tensor],
    max_seq_len: int | None = None,
    num_attention_heads: int | None = None,
) -> dict[str, torch.Tensor]:
    """A ``GPTNeoXForCausalLM`` state dict under the distributed LM head's names
    (``max_seq_len``, which SMP's older name takes, is not needed)."""
    del max_seq_len
    heads = _head_count(num_attention_heads)
    last = causal.layer_count(state_dict, "gpt_neox.layers.") - 1
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        kind = parts[-1]
        name = ".".join(parts[3:-1])
        if parts[0] in ("lm_head", "embed_out"):  # embed_out: older transformers' name
            out[f"lm_head.{kind}"] = value
        elif parts[:2] == ["gpt_neox", "embed_in"]:
            out[f"word_embedding.{kind}"] = value
        elif parts[:2] == ["gpt_neox", "final_layer_norm"]:
            out[f"transformer.seq_layers.{last}.output.layernorm.{kind}"] = value
        elif parts[:2] != ["gpt_neox", "layers"]:
            raise ModelParallelError(f"{WHAT}: unknown key {key!r}")
        elif name in ("attention.bias", "attention.masked_bias", "attention.rotary_emb"):
            continue  # older transformers' causal masks and rotary buffers
        elif name == "attention.query_key_value":
            per_head = value.view(heads, 3, -1, *value.shape[1:])  # each head's q, k, v rows
            for i, part in enumerate(_QKV):
                whole = per_head[:, i].reshape(-1, *value.shape[1:])
                out[f"transformer.seq_layers.{parts[2]}.attention.{part}.{kind}"] = whole
        elif name in _BLOCK:
            out[f"transformer.seq_layers.{parts[2]}.{_BLOCK[name]}.{kind}"] = value
        else:
            raise ModelParallelError(f"{WHAT}: unknown key {key!r}")
    return out


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
    last = str(causal.layer_count(state_dict, "transformer.seq_layers.") - 1)
    block = {mine: theirs for theirs, mine in _BLOCK.items()}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        kind = parts[-1]
        name = ".".join(parts[3:-1])
        if parts[0] == "lm_head":
            out[key] = value
        elif parts[0] == "word_embedding":
            out[f"gpt_neox.embed_in.{kind}"] = value
        elif parts[:2] != ["transformer", "seq_layers"]:
            raise ModelParallelError(f"{WHAT}: unknown key {key!r}")
        elif name == "output.layernorm" and parts[2] == last:
            out[f"gpt_neox.final_layer_norm.{kind}"] = value
        elif name in (f"attention.{part}" for part in _QKV):
            fused = f"gpt_neox.layers.{parts[2]}.attention.query_key_value.{kind}"
            qkv.setdefault(fused, {})[parts[4]] = value
        elif name in block:
            out[f"gpt_neox.layers.{parts[2]}.{block[name]}.{kind}"] = value
        else:
            raise ModelParallelError(f"{WHAT}: unknown key {key!r}")
    for key, parts_of in qkv.items():
        per_head = [parts_of[part].view(heads, -1, *parts_of[part].shape[1:]) for part in _QKV]
        out[key] = torch.stack(per_head, dim=1).reshape(-1, *per_head[0].shape[2:])
    return out


translate_hf_gptneox_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptneox
"""SMP's older name, which takes ``max_seq_len`` too."""

REGISTRATION = Registration(
    DistributedTransformerLMHead,
    init_hook=init_hook,
    forward_hook=forward_hook,
    return_hook=return_hook,
    translate=translate_hf_state_dict_to_smdistributed_gptneox,
)

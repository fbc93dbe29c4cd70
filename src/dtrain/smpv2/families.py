"""The Hugging Face models ``torch.sagemaker.transform`` splits, and how: SMP v1's in-place
families (:mod:`dtrain.modelparallel.tensor.huggingface`), named under SMP v2's API.

GPT-NeoX and Llama split as SMP v1 splits them in place; Mistral's layers are named as Llama's;
Mixtral's attention is Llama's, and its mixture-of-experts block (``mlp``: the router and the
experts) stays whole on every tp rank (:data:`REPLICATED`): expert parallelism is not built yet.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.huggingface import gptneox, llama
from dtrain.modelparallel.tensor.huggingface.family import Family

WHAT = "torch.sagemaker.transform"

FAMILIES: dict[str, Family] = {
    "transformers.models.gpt_neox.modeling_gpt_neox": replace(gptneox.FAMILY, api=WHAT),
    "transformers.models.llama.modeling_llama": replace(llama.FAMILY, api=WHAT),
    "transformers.models.mistral.modeling_mistral": replace(llama.FAMILY, name="mistral", api=WHAT),
    "transformers.models.mixtral.modeling_mixtral": replace(
        llama.FAMILY,
        name="mixtral",
        api=WHAT,
        colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        rowwise=("self_attn.o_proj",),
        sizes=("num_attention_heads", "num_key_value_heads"),
    ),
}
"""HF modelling modules → their family; every ``PreTrainedModel`` of such a module
(``LlamaForCausalLM``, ``MistralModel``, ...) is transformed."""

REPLICATED = {"mixtral": "mlp"}
"""A layer's module each tp rank keeps whole, by family: its inputs and gradients are whole on
every rank (the norm before it and the residual are), so it trains as in one process, at the
memory and compute of one process."""


def family_of(model: nn.Module) -> Family:
    """The family of HF model ``model``; any other model fails, naming what is supported."""
    kind = type(model)
    family = FAMILIES.get(kind.__module__)
    if family is None or not hasattr(kind, "base_model_prefix"):
        raise ModelParallelError(
            f"{WHAT}: {kind.__qualname__} is not supported; supported: Hugging Face GPT-NeoX, "
            "Llama, Mistral and Mixtral models (transformers.models.gpt_neox, llama, mistral, "
            "mixtral)"
        )
    return family

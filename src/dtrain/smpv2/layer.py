"""SMP v2's ``TransformerLayer`` (``torch.sagemaker.tensor_parallel.transformer``): the class
AWS's scripts give FSDP's ``transformer_auto_wrap_policy`` and activation checkpointing's check
once a model is transformed. The transform keeps Hugging Face's layers, so each of them
becomes an instance of both its own class and this one, as FSDP2's ``fully_shard`` gives a
module a class of its own."""

from __future__ import annotations

from torch import nn

_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


class TransformerLayer(nn.Module):
    """A transformer layer of a transformed model (see the module)."""

    def __init__(self) -> None:
        raise TypeError(
            "torch.sagemaker.tensor_parallel.transformer.TransformerLayer is not built directly "
            "in dtrain: torch.sagemaker.transform makes a Hugging Face model's layers "
            "TransformerLayers"
        )


def make_transformer_layer(layer: nn.Module) -> None:
    """Make ``layer`` an instance of :class:`TransformerLayer` too, keeping its class's name
    and behaviour."""
    if isinstance(layer, TransformerLayer):
        return
    kind = type(layer)
    if kind not in _CLASSES:
        names = {"__module__": kind.__module__}
        _CLASSES[kind] = type(kind.__name__, (kind, TransformerLayer), names)
    layer.__class__ = _CLASSES[kind]

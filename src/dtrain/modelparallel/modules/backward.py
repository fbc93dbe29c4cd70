"""Where a microbatch's backward starts: ``model.backward``'s gradients, scaled.

Both engines start a microbatch's backward from the same gradients: the script's (ones for a
scalar loss) times the scale the step applies (the microbatch average, the fp16 loss scale).
"""

from __future__ import annotations

import torch


def scaled_grads(
    outputs: list[torch.Tensor], grads: list[torch.Tensor | None], scale: float | None
) -> list[torch.Tensor | None]:
    """The gradients of ``outputs`` for ``backward``, multiplied by the microbatch ``scale``."""
    if scale is None:
        return grads
    return [
        (torch.ones_like(out) if g is None else g) * scale
        for out, g in zip(outputs, grads, strict=True)
    ]

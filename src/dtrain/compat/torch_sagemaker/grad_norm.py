"""``torch.sagemaker.grad_norm``: gradient clipping over tensor-parallel and sharded gradients
(:mod:`dtrain.smpv2.grad_norm`)."""

from dtrain.smpv2.grad_norm import clip_grad_norm_

__all__ = ["clip_grad_norm_"]

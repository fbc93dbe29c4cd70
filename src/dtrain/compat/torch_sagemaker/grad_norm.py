"""``torch.sagemaker.grad_norm``: gradient clipping over tensor-parallel and sharded gradients."""

from dtrain.smpv2.unavailable import Unavailable

clip_grad_norm_ = Unavailable("torch.sagemaker.grad_norm.clip_grad_norm_")

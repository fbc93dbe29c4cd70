"""``torch.sagemaker.nn.attn``: flash attention modules."""

from dtrain.smpv2.unavailable import Unavailable

FlashSelfAttention = Unavailable("torch.sagemaker.nn.attn.FlashSelfAttention")
FlashGroupedQueryAttention = Unavailable("torch.sagemaker.nn.attn.FlashGroupedQueryAttention")

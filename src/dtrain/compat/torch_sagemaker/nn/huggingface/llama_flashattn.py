"""``torch.sagemaker.nn.huggingface.llama_flashattn``."""

from dtrain.smpv2.unavailable import Unavailable

LlamaFlashAttention = Unavailable(
    "torch.sagemaker.nn.huggingface.llama_flashattn.LlamaFlashAttention"
)

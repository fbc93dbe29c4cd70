"""``torch.sagemaker.nn.huggingface``."""

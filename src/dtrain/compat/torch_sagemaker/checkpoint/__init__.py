"""``torch.sagemaker.checkpoint``: its module ``utils``."""

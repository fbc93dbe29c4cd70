"""``torch.sagemaker.distributed``: its package ``checkpoint``."""

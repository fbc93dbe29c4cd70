"""``torch.sagemaker.utils``: its modules ``utils`` and ``process_group_utils``."""

"""``torch.sagemaker.nn``: SMP's attention modules."""

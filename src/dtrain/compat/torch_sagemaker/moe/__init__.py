"""``torch.sagemaker.moe``: mixture of experts (expert parallelism)."""

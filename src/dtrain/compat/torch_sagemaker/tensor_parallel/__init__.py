"""``torch.sagemaker.tensor_parallel``: the layers ``tsm.transform`` puts in a model."""

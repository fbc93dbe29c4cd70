"""dtrain: SageMaker-style distributed training jobs, data and model parallel on PyTorch."""

__version__ = "0.1.0"

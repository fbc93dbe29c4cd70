"""``smdistributed.modelparallel``: SageMaker's model-parallel library (v1), provided by dtrain."""

__version__ = "1.15.0"
"""The SMP v1 release whose API dtrain provides; Hugging Face ``transformers`` reads it."""

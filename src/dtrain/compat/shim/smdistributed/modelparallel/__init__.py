"""``smdistributed.modelparallel``: SageMaker's model-parallel library (v1), provided by dtrain."""

"""``smdistributed.dataparallel``: SageMaker's data-parallel library, provided by dtrain."""

"""dtrain's stand-in for SageMaker's ``smdistributed`` package (see ``dtrain.compat``)."""

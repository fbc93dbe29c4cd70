"""``smdistributed.dataparallel.torch``: see ``dtrain.dataparallel``."""

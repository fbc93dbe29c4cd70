"""``dtrain``'s commands that have a module of their own (the others are in :mod:`dtrain.cli`)."""

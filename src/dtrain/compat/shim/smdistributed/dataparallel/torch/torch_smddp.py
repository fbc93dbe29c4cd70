"""Importing this registers the ``smddp`` backend: ``init_process_group(backend="smddp")``."""

from dtrain.dataparallel import register_smddp_backend

register_smddp_backend()

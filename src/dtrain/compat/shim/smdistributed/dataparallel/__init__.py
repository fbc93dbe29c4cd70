"""``smdistributed.dataparallel``: SageMaker's data-parallel library, provided by dtrain.

Importing any of its modules makes ``init_process_group(backend="smddp")`` available, as on
SageMaker, where the library is loaded whole; ``torch_smddp`` need not be imported first.
"""

from dtrain.dataparallel import register_smddp_backend

register_smddp_backend()

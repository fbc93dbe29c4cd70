"""``smdistributed.modelparallel.torch.nn.huggingface``: see ``dtrain.modelparallel.nn``."""

from dtrain.modelparallel.tensor.huggingface import *  # noqa: F403  (the module is the API)
from dtrain.modelparallel.tensor.huggingface import __all__  # noqa: F401

"""SMP v2's activation offloading under torch's name, in processes that import ``torch.sagemaker``.

AWS's scripts offload activations (``sm_activation_offloading``) with torch's ``offload_wrapper``,
imported from ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` after
``torch.sagemaker``; SMP's own torch offloads its layers' plain tensors. :func:`install` rebinds
that name, in memory, to :func:`dtrain.smpv2.offload.offload_wrapper`, which takes the DTensors
of a model ``tsm.transform`` split as well (torch's fails on them) and offloads plain tensors as
torch's does: the installed torch is left as it is.
"""

from __future__ import annotations

import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as checkpoint_wrapper

from dtrain.smpv2.offload import offload_wrapper


def install() -> None:
    """Rebind torch's ``offload_wrapper`` to SMP v2's; idempotent."""
    checkpoint_wrapper.offload_wrapper = offload_wrapper

"""``import torch.sagemaker as tsm``: SMP v2's API, served by :mod:`dtrain.smpv2`.

This package is importable as ``torch.sagemaker`` (:mod:`dtrain.compat.graft`). Its modules follow
SMP v2's import paths, as AWS's scripts import them; what dtrain does not implement yet is there
too, and fails naming itself when used (:mod:`dtrain.smpv2.unavailable`). Importing it puts SMP
v2's FSDP and activation offloading under torch's names (:mod:`dtrain.compat.torch_fsdp`,
:mod:`dtrain.compat.torch_offload`).
"""

from dtrain.compat import torch_fsdp, torch_offload
from dtrain.smpv2 import init, is_initialized, state
from dtrain.smpv2.api import transform

torch_fsdp.install()
torch_offload.install()

__all__ = ["init", "is_initialized", "state", "transform"]

"""The ``smddp`` torch.distributed backend name, as SMDDP v1.4+ scripts use it.

``import smdistributed.dataparallel.torch.torch_smddp`` followed by
``dist.init_process_group(backend="smddp")`` is the SageMaker idiom. Here ``smddp`` is a thin alias:
the creator builds a NCCL process group when CUDA is available and a gloo one otherwise, so plain
``torch.nn.parallel.DistributedDataParallel`` (or FSDP) runs over it unchanged. Our bucketing and
hierarchical reduction live in ``dtrain.dataparallel.DistributedDataParallel``, which works over
any group including this one; no DDP comm hook is registered for torch's DDP.

Like SMDDP, one backend serves the job: on a CUDA machine the group is NCCL only, so CPU tensors
need a separate gloo group (SMDDP documents the same: it "can't be mixed with NCCL/Gloo").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as BackendObject
from torch._C._distributed_c10d import _DistributedBackendOptions

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName  # not in torch 2.6

SMDDP = "smddp"


def register_smddp_backend() -> None:
    """Make ``backend="smddp"`` valid for ``init_process_group`` and ``new_group``; idempotent."""
    if SMDDP in dist.Backend.backend_list:
        return
    # One device type: registered for CPU too, the NCCL group would be handed the CPU tensors of
    # object collectives (all_gather_object, broadcast_object_list). For CUDA only, torch moves
    # those objects to the GPU first, as it does for a NCCL group.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.Backend.register_backend(SMDDP, _create_backend, extended_api=True, devices=[device])


def _create_backend(options: _DistributedBackendOptions, backend_options: Any) -> BackendObject:
    """torch's creator callback: the same backend object torch would build for nccl or gloo."""
    if torch.cuda.is_available():
        nccl_options = backend_options or dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = options.timeout
        nccl_options.global_ranks_in_group = options.global_ranks_in_group
        nccl_options.group_name = options.group_id
        return dist.ProcessGroupNCCL(
            options.store, options.group_rank, options.group_size, nccl_options
        )
    gloo = dist.ProcessGroupGloo(
        options.store, options.group_rank, options.group_size, options.timeout
    )
    gloo.options.global_ranks_in_group = options.global_ranks_in_group
    gloo.options.group_name = cast("GroupName", options.group_id)
    return gloo

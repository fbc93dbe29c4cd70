"""SageMaker model parallelism v1 (``smdistributed.modelparallel.torch``), implemented by dtrain.

Scripts use it as SMP: ``import dtrain.modelparallel as smp`` (or, under ``dtrain run``,
``import smdistributed.modelparallel.torch as smp``), then ``smp.init()``,
``smp.DistributedModel``, ``@smp.step``; large models are created inside
``smp.delay_param_initialization()`` or ``smp.model_creation()``. ``smp.nn`` holds SMP's
tensor-parallel modules, ``smp.optimizers`` its ``FusedLAMB``,
``smp.sharded_data_parallel_checkpoint`` the reading of a sharded partial checkpoint whole
(imported on first use, so not in ``__all__``).
"""

import importlib
from typing import Any

from dtrain.modelparallel.api import amp
from dtrain.modelparallel.api.checkpoint import load, resume_from_checkpoint, save, save_checkpoint
from dtrain.modelparallel.api.comm import (
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    RDP_GROUP,
    TP_GROUP,
    WORLD,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    gather,
    mp_barrier,
    pp_barrier,
    rdp_barrier,
    recv_from,
    send,
    tp_barrier,
)
from dtrain.modelparallel.api.creation import model_creation
from dtrain.modelparallel.api.model import DistributedModel
from dtrain.modelparallel.api.optimizer import DistributedOptimizer
from dtrain.modelparallel.api.placement import partition, set_partition
from dtrain.modelparallel.api.step import StepOutput, step
from dtrain.modelparallel.deferred import delay_param_initialization
from dtrain.modelparallel.modules.activations import set_activation_checkpointing
from dtrain.modelparallel.state import (
    dp_rank,
    dp_size,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_process_group,
    init,
    is_initialized,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    num_microbatches,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    reset,
    shutdown,
    size,
    tp_rank,
    tp_size,
)
from dtrain.modelparallel.tensor.marks import (
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)

ON_FIRST_USE = {
    "nn": "dtrain.modelparallel.nn",
    "optimizers": "dtrain.modelparallel.optimizers",
    "sharded_data_parallel_checkpoint": "dtrain.modelparallel.api.sharded_checkpoint",
}
"""SMP's namespaces imported on first use: DTensor, which ``smp.nn`` needs, takes a second to
import."""

NOT_SERVED = {
    "hvd_average_grads": (
        "Horovod's gradient averaging (SMP's hybrid data parallelism with horovod: true): "
        "dtrain has no Horovod; with ddp: true the gradients are averaged over the "
        "data-parallel group at each step"
    ),
}
"""SMP names AWS's scripts use that dtrain does not serve, and why."""


def __getattr__(name: str) -> Any:
    if name in ON_FIRST_USE:
        return importlib.import_module(ON_FIRST_USE[name])
    if name in NOT_SERVED:
        raise AttributeError(f"smp.{name}: not served: {NOT_SERVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DP_GROUP",
    "MP_GROUP",
    "PP_GROUP",
    "RDP_GROUP",
    "TP_GROUP",
    "WORLD",
    "CommGroup",
    "DistributedModel",
    "DistributedOptimizer",
    "RankType",
    "StepOutput",
    "allgather",
    "amp",
    "barrier",
    "broadcast",
    "delay_param_initialization",
    "dp_barrier",
    "dp_rank",
    "dp_size",
    "gather",
    "get_dp_group",
    "get_dp_process_group",
    "get_mp_group",
    "get_mp_process_group",
    "get_pp_group",
    "get_pp_process_group",
    "get_rdp_group",
    "get_rdp_process_group",
    "get_tp_group",
    "get_tp_process_group",
    "get_world_process_group",
    "init",
    "is_initialized",
    "load",
    "local_rank",
    "local_size",
    "model_creation",
    "mp_barrier",
    "mp_rank",
    "mp_size",
    "num_microbatches",
    "partition",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "rank",
    "rdp_barrier",
    "rdp_rank",
    "rdp_size",
    "recv_from",
    "reset",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "send",
    "set_activation_checkpointing",
    "set_partition",
    "set_tensor_parallelism",
    "shutdown",
    "size",
    "step",
    "tensor_parallelism",
    "tp_barrier",
    "tp_rank",
    "tp_register",
    "tp_register_with_module",
    "tp_size",
]

"""The start of an SMP v2 script, in the order of AWS's shared-scripts/train_lib.py: the smddp
backend, ``tsm.init()``, ``tsm.state``; then one FSDP step over smddp's all-gather and
reduce-scatter, with FSDP1 as AWS's scripts wrap models (hybrid sharding) and with FSDP2, both on
``tsm.state``'s mesh, each checked against one process's step on the whole batch.

Prints ``STATE <json>`` (what the script reads from ``tsm.state``, and the launcher's variables it
got) and ``FSDP OK`` per rank.
"""

import torch.sagemaker as tsm  # before torch, as a script may

# isort: split
import copy
import json
import os
import sys

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  (registers the backend)
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard
from torch.sagemaker.logger import get_logger
from torch.sagemaker.utils import utils as tsm_utils
from torch.sagemaker.utils.process_group_utils import get_global_ranks

LAUNCHER = ("RANK", "LOCAL_", "WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_")
LAUNCHER += ("TORCH_NCCL_",)

dist.init_process_group("smddp")
rank, world = dist.get_rank(), dist.get_world_size()
tsm.state.expert_parallel_degree = 1  # as AWS's script does without SMP's implementation
with tsm_utils.timeit(True, "tsm.init", rank):
    tsm.init()
state = tsm.state
report = {
    "rank": rank,
    "backend": dist.get_backend(),
    "degrees": [state.tensor_parallel_degree, state.context_parallel_degree,
                state.expert_parallel_degree, state.hybrid_shard_degree],
    "tp": [state.tp_rank, state.tp_size, get_global_ranks(state.tp_process_group)],
    "cp": [state.cp_rank, state.cp_size],
    "rep": [state.ranker.get_rep_rank(rank), state.ranker.get_rep_groups()],
    "world": get_global_ranks(state.world_process_group),
    "dp_rank": rank // (state.tensor_parallel_degree * state.context_parallel_degree),
    "offloading": state.sm_activation_offloading,
    "fsdp_mesh": state.mesh("replicate", "hybrid_shard").mesh.tolist(),
    "launcher": {name: value for name, value in os.environ.items() if name.startswith(LAUNCHER)},
}  # fmt: skip
# One write: under torchrun both ranks share one pipe, and print's text and newline would be two
# writes where Python's output is unbuffered (PYTHONUNBUFFERED), letting the other rank's between.
sys.stdout.write("STATE " + json.dumps(report) + "\n")
sys.stdout.flush()
get_logger().info("state read on rank %d", rank)

torch.manual_seed(0)
reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
inputs, targets = torch.randn(4 * world, 4), torch.randn(4 * world, 2)
mine = slice(4 * report["dp_rank"], 4 * report["dp_rank"] + 4)


def train_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


expected = copy.deepcopy(reference)
train_step(expected, inputs, targets)  # one process, the whole batch

fsdp1 = FullyShardedDataParallel(
    copy.deepcopy(reference),
    sharding_strategy=ShardingStrategy.HYBRID_SHARD,  # AWS's scripts' default
    device_mesh=state.mesh("replicate", "hybrid_shard"),
    use_orig_params=True,
    device_id=torch.device("cpu"),  # AWS's scripts: torch.cuda.current_device()
)
train_step(fsdp1, inputs[mine], targets[mine])
with FullyShardedDataParallel.summon_full_params(fsdp1):
    for got, want in zip(fsdp1.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got, want)

fsdp2 = copy.deepcopy(reference)
fully_shard(fsdp2, mesh=state.mesh("replicate", "hybrid_shard"))
train_step(fsdp2, inputs[mine], targets[mine])
for got, want in zip(fsdp2.parameters(), expected.parameters(), strict=True):
    torch.testing.assert_close(got.full_tensor(), want)

print(f"FSDP OK rank={rank}", flush=True)
dist.destroy_process_group()

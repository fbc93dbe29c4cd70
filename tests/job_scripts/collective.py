"""A well-behaved job: all-reduce across ranks, report the environment, save a model on rank 0.

Only rank 0's loss falls with the step; the others print a loss of 100 + rank, so a metric
taken from any rank but 0 shows.
"""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from report import write_report

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
expected = world * (world + 1) / 2
assert value.item() == expected, (value, expected)
write_report(rank)
for step in range(3):
    loss = 1.0 / (step + 1) if rank == 0 else 100.0 + rank
    print(f"step={step} loss={loss:.4f}", flush=True)
if rank == 0:
    Path(os.environ["SM_MODEL_DIR"], "weights.txt").write_text("trained")
dist.barrier()
dist.destroy_process_group()

"""DDP, then async all_gathers left pending at exit and the process group destroyed: the pattern
that makes plain ``python``/``torchrun`` abort a finished rank at interpreter shutdown."""

import atexit

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
atexit.register(print, f"rank {rank} atexit ran", flush=True)
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
for _ in range(8):
    dist.all_gather([torch.empty(1024) for _ in range(world)], torch.randn(1024), async_op=True)
dist.destroy_process_group()
print(f"rank {rank} finished", flush=True)

"""An unmodified SMDDP v1 script: smdistributed's own import paths, run by dtrain."""

import smdistributed.dataparallel.torch.distributed as dist
import torch
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP
from torch import nn

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)  # different init per rank: DDP must broadcast rank 0's parameters
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    x = torch.randn(4, 8)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
assert all(torch.equal(gathered[0], g) for g in gathered), "replicas diverged"
average = torch.tensor([float(rank)])
dist.all_reduce(average, op=dist.ReduceOp.AVERAGE)
assert average.item() == (world - 1) / 2
print(f"smddp v1 ok rank={rank} local_rank={dist.get_local_rank()} world={world}", flush=True)

"""An unmodified SMDDP v1.4+ script: the ``smddp`` backend under plain torch DDP."""

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  (registers the backend)
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group(backend="smddp")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    optimizer.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
assert all(torch.equal(gathered[0], g) for g in gathered), "replicas diverged"
print(f"smddp backend ok rank={rank} backend={dist.get_backend()}", flush=True)
dist.destroy_process_group()

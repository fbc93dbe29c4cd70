"""On GPUs (NCCL): each rank on its own GPU; dtrain's DDP and torch's DDP train the same model on
the same data; rank 0 saves both results and the GPU each rank used."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtrain.dataparallel import DistributedDataParallel

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", local_rank)
uuid = str(torch.cuda.get_device_properties(device).uuid)
uuids = [None] * world
dist.all_gather_object(uuids, uuid)


def train(wrap):
    torch.manual_seed(0)
    model = wrap(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        generator = torch.Generator(device=device).manual_seed(100 * step + rank)
        x = torch.randn(16, 64, device=device, generator=generator)
        y = torch.randn(16, 8, device=device, generator=generator)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return {name: p.detach().cpu() for name, p in model.module.named_parameters()}


ours = train(lambda m: DistributedDataParallel(m, bucket_cap_mb=0.01))
torchs = train(lambda m: nn.parallel.DistributedDataParallel(m, device_ids=[local_rank]))
if rank == 0:
    result = {"ours": ours, "torch": torchs, "uuids": uuids}
    torch.save(result, Path(os.environ["SM_MODEL_DIR"], "gpu.pt"))
dist.destroy_process_group()

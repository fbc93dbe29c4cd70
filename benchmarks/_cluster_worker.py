"""The training script both launchers run in ``benchmarks/cluster.py``.

``--ddp torch`` wraps the model in torch's DistributedDataParallel, ``--ddp dtrain`` in dtrain's
(hierarchical, bf16 gradients). Rank 0 writes, to ``--out``, the wall-clock time its first step
ended and the step times after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp", choices=("torch", "dtrain"), required=True)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--out", required=True)
    args, _ = parser.parse_known_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    if args.ddp == "torch":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from dtrain.dataparallel import DistributedDataParallel

        model = DistributedDataParallel(model, hierarchical=True, compression="bf16")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch // world, args.width, generator=generator)
    y = torch.randn(args.batch // world, args.width, generator=generator)
    times, first_step_end = [], 0.0
    for step in range(args.steps):
        dist.barrier()
        started = time.perf_counter()
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - started)
        if step == 0:
            first_step_end = time.time()
    if rank == 0:
        result = {"first_step_end": first_step_end, "step_s": times[args.warmup :]}
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

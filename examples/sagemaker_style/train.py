"""A training script written the SageMaker way.

Hyperparameters arrive as arguments, data and model dirs from SM_*.

It runs unchanged on SageMaker (PyTorch estimator) and under ``dtrain run``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "model"))
    parser.add_argument("--train", default=os.environ.get("SM_CHANNEL_TRAINING", "data"))
    return parser.parse_args()


def load_shards(directory: str) -> tuple[torch.Tensor, torch.Tensor]:
    shards = [torch.load(path) for path in sorted(Path(directory).rglob("*.pt"))]
    if not shards:
        raise FileNotFoundError(f"no .pt files in training channel {directory}")
    return torch.cat([s["x"] for s in shards]), torch.cat([s["y"] for s in shards])


def my_rows(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the rows, as a DistributedSampler would give it: ShardedByS3Key
    already gave each host its own files, so the processes of a host split them (by local
    rank); FullyReplicated gave every host all of them, so every rank takes its share (by
    rank). Every rank keeps as many rows as the one with the fewest, so that all of them take
    the same number of steps (DDP's collectives wait for every rank)."""
    channel = json.loads(os.environ.get("SM_INPUT_DATA_CONFIG", "{}")).get("training", {})
    if channel.get("S3DistributionType") == "ShardedByS3Key":
        index, count = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    else:
        index, count = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    x, y = x[index::count], y[index::count]
    if dist.is_initialized():
        rows = torch.tensor(len(x))
        dist.all_reduce(rows, op=dist.ReduceOp.MIN)
        x, y = x[: int(rows)], y[: int(rows)]
    return x, y


def main() -> None:
    args = parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    hosts = json.loads(os.environ.get("SM_HOSTS", '["local"]'))

    x, y = my_rows(*load_shards(args.train))
    host = os.environ.get("SM_CURRENT_HOST")
    print(f"rank {rank}/{world_size} on {host} of {hosts}: training on {len(x)} rows")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(x.shape[1], args.hidden), nn.ReLU(), nn.Linear(args.hidden, int(y.max()) + 1)
    )
    if world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(1, args.epochs + 1):
        permutation = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        total, batches = 0.0, 0
        for start in range(0, len(x), args.batch_size):
            index = permutation[start : start + args.batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x[index]), y[index])
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        with torch.no_grad():
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        print(f"epoch={epoch} train_loss={total / batches:.4f} train_accuracy={accuracy:.4f}")

    if rank == 0:
        Path(args.model_dir).mkdir(parents=True, exist_ok=True)
        module = model.module if world_size > 1 else model
        torch.save(module.state_dict(), Path(args.model_dir) / "model.pt")
        print(f"saved model to {args.model_dir}")
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Write a small synthetic classification dataset as several shard files (no downloads needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write shard-XX.pt files into")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--samples-per-shard", type=int, default=256)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(args.seed)
    centers = torch.randn(args.classes, args.features, generator=generator) * 0.6
    args.out.mkdir(parents=True, exist_ok=True)
    for shard in range(args.shards):
        labels = torch.randint(args.classes, (args.samples_per_shard,), generator=generator)
        noise = torch.randn(args.samples_per_shard, args.features, generator=generator)
        features = centers[labels] + noise
        torch.save({"x": features, "y": labels}, args.out / f"shard-{shard:02d}.pt")
    print(f"wrote {args.shards} shards of {args.samples_per_shard} samples to {args.out}")


if __name__ == "__main__":
    main()

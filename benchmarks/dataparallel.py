"""dtrain.dataparallel against torch's DistributedDataParallel, in the same world, same run.

The model and step are those of the machine baseline (docs: machine-baselines §2): a 3.7M-parameter
causal transformer LM (4 layers, d_model 256), sequence 128, 8 sequences per rank, AdamW, one
thread per rank, gloo on loopback. Variants alternate within each repeat so machine noise hits
them alike; a step's time is the slowest rank's, and each variant reports the median step.

    python benchmarks/dataparallel.py --world 2 --steps 20 --repeats 3 --json out/dp.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from dtrain.dataparallel import DistributedDataParallel

VOCAB, SEQ, D_MODEL, LAYERS = 1024, 128, 256, 4


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.position = nn.Parameter(torch.zeros(SEQ, D_MODEL))
        layer = nn.TransformerEncoderLayer(
            D_MODEL, 4, 1024, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)
        # a constant, not a buffer: no wrapper has buffers to broadcast
        self.mask = nn.Transformer.generate_square_subsequent_mask(SEQ)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(tokens) + self.position, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


Wrap = Callable[[nn.Module], nn.Module]
VARIANTS: dict[str, Wrap] = {
    "torch DDP": nn.parallel.DistributedDataParallel,
    "dtrain": DistributedDataParallel,
    "dtrain 4MB buckets": lambda m: DistributedDataParallel(m, bucket_cap_mb=4),
    "dtrain fp16": lambda m: DistributedDataParallel(m, compression="fp16"),
}


def time_steps(model: nn.Module, steps: int, warmup: int, batch: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(elapsed.item())
    return times


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, wrap in VARIANTS.items():
            torch.manual_seed(0)
            times = time_steps(wrap(TinyLM()), args.steps, args.warmup, args.batch)
            medians[name].append(statistics.median(times))
    if rank == 0:
        Path(out).write_text(json.dumps(medians))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = Path(f"/tmp/dtrain-dp-bench-{os.getpid()}.json")
    mp.spawn(worker, args=(args.world, port, args, str(out)), nprocs=args.world)
    medians = json.loads(out.read_text())
    out.unlink()
    baseline = statistics.median(medians["torch DDP"])
    rows = []
    print(f"{'variant':20s} {'step ms':>8s} {'vs torch':>9s}  runs (ms)")
    for name, runs in medians.items():
        median = statistics.median(runs)
        rows.append({"variant": name, "step_ms": 1000 * median, "ratio": median / baseline})
        listing = ", ".join(f"{1000 * r:.0f}" for r in runs)
        print(f"{name:20s} {1000 * median:8.1f} {median / baseline:9.3f}  [{listing}]")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"world": args.world, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

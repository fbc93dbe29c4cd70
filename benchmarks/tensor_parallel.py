"""Tensor parallelism: ``smp.nn.DistributedTransformerLayer`` at tp=2 against torch's own.

Both sides compute one pre-norm transformer layer (width ``--hidden``, 4x feed-forward, heads of
64) over the same rows with the same split: query/key/value and the feed-forward's first layer
column-parallel, the attention's output and the feed-forward's second layer row-parallel
(``torch.distributed.tensor.parallel``'s ``ColwiseParallel`` / ``RowwiseParallel``).

* **dtrain**: SMP's semantics. Each tp rank brings its own ``--batch`` rows; the layer gathers
  the group's rows, computes on all of them split by heads and features, and gives each rank its
  rows back (SMP's scaled batch).
* **torch**: ``parallelize_module`` on the same layer written plainly; both ranks are given the
  same ``2 x --batch`` rows (torch's tensor parallelism replicates the input), so both sides do
  the same arithmetic per step.

A step is forward, backward and an AdamW step. The two take turns in one 2-process world in ABBA
order (``--repeats`` pairs of ``--steps`` timed steps after ``--warmup``), each turn's median
step, then the median of the pairs' dtrain/torch ratios. Beside the step's wall time (the
slower rank's), each turn's median CPU time per step (a rank's process, all its threads, gloo's
included; the mean of the two ranks) and the pairs' ratios of it: on a machine shared with
other work, time a rank waits for the CPU counts in the wall time but not in the CPU time,
while a rank's time waiting for the other is in neither. Memory: the parameter and AdamW-state
bytes a rank holds at tp=2 over one process holding the whole layer (its local shards; the
norms are replicated).

    python benchmarks/tensor_parallel.py --json out/tp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import dtrain.modelparallel as smp
from modelparallel import init_world, leave_world, spawn  # benchmarks/ is the script's dir

HEAD = 64


class PlainLayer(nn.Module):
    """The layer SMP's ``DistributedTransformerLayer`` computes, written for torch's styles: a
    column-split projection hands each rank its heads (local tensors), a row-split one sums."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.dense = nn.Linear(hidden, hidden)
        self.dense1, self.dense2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        n, s, _ = hidden.shape
        x = self.norm1(hidden)
        q, k, v = (
            layer(x).view(n, s, -1, HEAD).transpose(1, 2)
            for layer in (self.query, self.key, self.value)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden = hidden + self.dense(attended.transpose(1, 2).reshape(n, s, -1))
        return hidden + self.dense2(F.gelu(self.dense1(self.norm2(hidden))))


def build(args: argparse.Namespace, side: str) -> nn.Module:
    if side == "dtrain":
        return smp.nn.DistributedTransformerLayer(
            num_attention_heads=args.hidden // HEAD,
            attention_head_size=HEAD,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            attention_dropout_prob=0.0,
            hidden_dropout_prob=0.0,
            causal_mask_size=args.seq,
            pre_layernorm=True,
            post_layernorm=False,
        )
    layer = PlainLayer(args.hidden)
    if side == "one process":
        return layer
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    plan = {name: ColwiseParallel() for name in ("query", "key", "value", "dense1")}
    plan.update(dense=RowwiseParallel(), dense2=RowwiseParallel())
    return parallelize_module(layer, mesh, plan)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters and optimizer state (a DTensor's local shard)."""
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    for state in optimizer.state.values():
        local += [getattr(v, "_local_tensor", v) for v in state.values() if v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in local)


def turn(args: argparse.Namespace, side: str, rank: int) -> dict[str, Any]:
    """``args.steps`` timed steps of one side; its median step and memory."""
    model = build(args, side)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank if side == "dtrain" else 0)
    rows = args.batch if side == "dtrain" else args.batch * dist.get_world_size()
    hidden = torch.randn(rows, args.seq, args.hidden, generator=generator)
    mask = torch.zeros(rows, 1, 1, args.seq)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = model((hidden, mask))[0] if side == "dtrain" else model(hidden)
        out.float().pow(2).mean().backward()
        optimizer.step()

    times, cpu_times = [], []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        began, began_cpu = time.perf_counter(), time.process_time()
        step()
        cpu = torch.tensor([time.process_time() - began_cpu])
        elapsed = torch.tensor([time.perf_counter() - began])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
        if index >= args.warmup:
            times.append(float(elapsed))
            cpu_times.append(float(cpu) / dist.get_world_size())
    return {
        "side": side,
        "median_ms": 1e3 * statistics.median(times),
        "cpu_ms": 1e3 * statistics.median(cpu_times),
        "state_bytes": state_bytes(model, optimizer),
    }


def worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    init_world(rank, 2, port, args.pin_cores)
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    abba = (("dtrain", "torch"), ("torch", "dtrain"))
    order = [side for pair in range(args.repeats) for side in abba[pair % 2]]
    rows = [turn(args, side, rank) for side in order]
    if rank == 0:
        with torch.random.fork_rng():
            whole = build(args, "one process")
            optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-4)
            whole(torch.zeros(1, args.seq, args.hidden)).sum().backward()
            optimizer.step()
            rows.append({"side": "one process", "state_bytes": state_bytes(whole, optimizer)})
    leave_world(results, rows if rank == 0 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="rows each tp rank brings")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="ABBA pairs")
    parser.add_argument("--pin-cores", action="store_true", help="rank r on CPU r")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = spawn(worker, 2, args)
    turns = [row for row in rows if "median_ms" in row]

    def ratios(key: str) -> list[float]:
        return [
            next(r for r in turns[i : i + 2] if r["side"] == "dtrain")[key]
            / next(r for r in turns[i : i + 2] if r["side"] == "torch")[key]
            for i in range(0, len(turns), 2)
        ]

    pairs, cpu_pairs = ratios("median_ms"), ratios("cpu_ms")
    state = {row["side"]: row["state_bytes"] for row in rows}
    report = {
        "torch": torch.__version__,
        "turns": turns,
        "pair_ratios": pairs,
        "dtrain_over_torch": statistics.median(pairs),
        "cpu_pair_ratios": cpu_pairs,
        "cpu_dtrain_over_torch": statistics.median(cpu_pairs),
        "state_bytes": state,
        "tp2_state_over_one_process": state["dtrain"] / state["one process"],
        "torch_tp2_state_over_one_process": state["torch"] / state["one process"],
    }
    print(f"tp=2 transformer layer, width {args.hidden}, {args.batch} rows of {args.seq} per rank")
    for row in turns:
        print(f"  {row['side']:7} {row['median_ms']:8.1f} ms, CPU {row['cpu_ms']:8.1f} ms per rank")
    for name, values, key in (("step", pairs, ""), ("CPU", cpu_pairs, "cpu_")):
        shown = [round(p, 3) for p in values]
        median = report[f"{key}dtrain_over_torch"]
        print(f"  dtrain / torch, {name}: pairs {shown}, median {median:.3f}")
    dtrain_state, torch_state = (
        report["tp2_state_over_one_process"],
        report["torch_tp2_state_over_one_process"],
    )
    print(
        f"  parameters + AdamW state per rank / one process: dtrain {dtrain_state:.3f}, "
        f"torch {torch_state:.3f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

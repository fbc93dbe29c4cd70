"""dtrain.dataparallel against torch's DistributedDataParallel, alternating step by step in one run.

Scenarios (each prints a table; ``--json`` writes every figure, skipped scenarios with the reason):

* ``loopback``: the 4-layer transformer LM of machine-baselines §2 (d_model 256, 4 heads, ff 1024,
  seq 128, vocab 1024, 3.7M parameters), global batch 16, AdamW, 2 processes of 1 thread, gloo
  on loopback. Two references run in the same rounds: one process training the whole global
  batch (the other rank idles), and both ranks training their halves with no gradient exchange
  (what any data-parallel library would cost if communication were free).
  Scaling efficiency = (T1 / 2) / T2, with T1 the single process's step on the global batch and
  T2 the 2-process step: 100 % means the 2 processes halve the step.
* ``netns``: 2 pretend hosts × 2 processes in network namespaces joined by a veth pair capped at
  1 Gbit/s each way (``tc tbf``), a model of large layers (4096 × 4096 Linear), global batch 64,
  SGD: communication-bound. torch DDP (flat ring across all 4 ranks) against dtrain's
  hierarchical reduction in fp32 and bf16, and bf16 with shared memory inside the host.
  Needs root and iproute2; skipped otherwise.

Every round runs one step of each variant, in an order rotated per round, so machine noise
(other jobs share these cores) hits them alike. A step is zero_grad, forward, backward and the
optimizer step, after a barrier; its time is the slowest rank's. Rounds are split into
``--repeats`` blocks; a variant's figure is the median over blocks of its median step, with the
blocks' range as the spread, and its ratio to torch DDP is taken block by block.

    python benchmarks/dataparallel.py --scenario all --json out/dataparallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import _netns  # benchmarks/ is the script's directory
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _lm import TransformerLM
from torch import nn

from dtrain.dataparallel import DistributedDataParallel
from dtrain.jobkey import KEY_ENV

SEQ, VOCAB = 128, 1024
LOOPBACK_BATCH = 16
NETNS_BATCH, WIDTH = 64, 4096
DDP = "torch DDP"
SINGLE = "1 process, global batch"
NO_EXCHANGE = "2 processes, no gradient exchange"

Wrap = Callable[[nn.Module], nn.Module]
LOOPBACK_VARIANTS: dict[str, Wrap] = {
    DDP: nn.parallel.DistributedDataParallel,
    "torch DDP, grad views": lambda m: nn.parallel.DistributedDataParallel(
        m, gradient_as_bucket_view=True
    ),
    "dtrain": DistributedDataParallel,
    "dtrain, grad views": lambda m: DistributedDataParallel(m, gradient_as_bucket_view=True),
    "dtrain shared memory": lambda m: DistributedDataParallel(m, shared_memory=True),
    "dtrain shared memory, grad views": lambda m: DistributedDataParallel(
        m, shared_memory=True, gradient_as_bucket_view=True
    ),
}
NETNS_VARIANTS: dict[str, Wrap] = {
    DDP: nn.parallel.DistributedDataParallel,
    "dtrain hierarchical fp32": lambda m: DistributedDataParallel(m, hierarchical=True),
    "dtrain hierarchical bf16": lambda m: DistributedDataParallel(
        m, hierarchical=True, compression="bf16"
    ),
    "dtrain hierarchical bf16, shared memory": lambda m: DistributedDataParallel(
        m, hierarchical=True, compression="bf16", shared_memory=True
    ),
}


# --- what every rank runs ----------------------------------------------------------------------

Step = Callable[[], None]


def lm_step(model: nn.Module, batch: int, seed: int) -> Step:
    """One AdamW step of ``model`` (a TransformerLM, maybe wrapped) on fixed random tokens."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(
        0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed)
    )

    def step() -> None:
        optimizer.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()

    return step


def wide_model(layers: int) -> nn.Module:
    """``layers`` Linear(4096, 4096) with ReLUs between: 16.8M parameters (67 MB) per layer."""
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for i in range(layers):
        modules += [nn.Linear(WIDTH, WIDTH)] + ([nn.ReLU()] if i < layers - 1 else [])
    return nn.Sequential(*modules)


def wide_step(model: nn.Module, batch: int, seed: int) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    x, y = (
        torch.randn(batch, WIDTH, generator=generator),
        torch.randn(batch, WIDTH, generator=generator),
    )

    def step() -> None:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    return step


def alternate(
    steps: dict[str, Step | None],
    rounds: int,
    warmup: int,
    counter: Callable[[], int] = lambda: 0,
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Per variant: seconds per step (slowest rank), and ``counter``'s growth over each step.

    One step of each variant per round. ``None``: this rank sits the variant out (it still
    joins the barrier and the max).
    """
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    counts: dict[str, list[int]] = {name: [] for name in names}
    for round_ in range(warmup + rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            step = steps[name]
            dist.barrier()
            count = counter()
            start = time.perf_counter()
            if step is not None:
                step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_ >= warmup:
                times[name].append(elapsed.item())
                counts[name].append(counter() - count)
    return times, counts


def loopback_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    per_rank = LOOPBACK_BATCH // world
    steps: dict[str, Step | None] = {
        name: lm_step(wrap(TransformerLM()), per_rank, seed=rank)
        for name, wrap in LOOPBACK_VARIANTS.items()
    }
    steps[NO_EXCHANGE] = lm_step(TransformerLM(), per_rank, seed=rank)
    steps[SINGLE] = lm_step(TransformerLM(), LOOPBACK_BATCH, seed=0) if rank == 0 else None
    times, _ = alternate(steps, args.rounds * args.repeats, args.warmup)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def netns_worker(args: argparse.Namespace) -> None:
    """One rank of the netns scenario, started inside its namespace by ``run_netns``."""
    _netns.die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    steps: dict[str, Step | None] = {
        name: wide_step(wrap(wide_model(args.layers)), NETNS_BATCH // world, seed=rank)
        for name, wrap in NETNS_VARIANTS.items()
    }
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    times, sent = alternate(
        steps, args.rounds * args.repeats, args.warmup, lambda: tx_bytes(interface)
    )
    if rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "sent": sent}))
    dist.destroy_process_group()


def tx_bytes(interface: str) -> int:
    """Bytes this namespace has sent through ``interface`` (0 where unreadable)."""
    counters = _netns.link_bytes(interface)
    return counters[0] if counters else 0


# --- scenarios, driven by the parent process ---------------------------------------------------


def run_loopback(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dtrain-dp-bench-") as tmp:
        out = Path(tmp) / "times.json"
        os.environ[KEY_ENV] = os.urandom(32).hex()  # the ranks' key, as dtrain run gives it
        mp.spawn(loopback_worker, args=(2, free_port(), args, str(out)), nprocs=2)
        times = json.loads(out.read_text())
    blocks = {name: block_medians(runs, args.repeats) for name, runs in times.items()}
    single = blocks.pop(SINGLE)
    rows = []
    for name, medians in blocks.items():
        row = summarize(name, medians, blocks[DDP])
        row["efficiency"] = median_and_range(
            [s / 2 / m for s, m in zip(single, medians, strict=True)]
        )
        rows.append(row)
    rows.append(summarize(SINGLE, single, blocks[DDP]))
    return {
        "setup": "2 processes x 1 thread, gloo on loopback, global batch 16, AdamW",
        "model": f"TransformerLM, {sum(p.numel() for p in TransformerLM().parameters())} params",
        "efficiency": "(T1 / 2) / T2, T1 = one process on the global batch, T2 = 2 processes",
        "rows": rows,
    }


def run_netns(args: argparse.Namespace) -> dict[str, Any]:
    reason = _netns.unavailable_reason()
    if reason:
        return {"skipped": reason}
    world, per_host = 4, 2
    try:
        with _netns.veth_pair(rate=args.rate) as hosts, tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "times.json"
            commands, envs = [], []
            key = os.urandom(32).hex()  # the ranks' key, as dtrain run's agents give it
            for rank in range(world):
                host = hosts[rank // per_host]
                script = str(Path(__file__).resolve())
                commands.append(host.command([sys.executable, script, *worker_argv(args, out)]))
                envs.append(
                    {
                        **os.environ,
                        "MASTER_ADDR": hosts[0].address,
                        "MASTER_PORT": "29500",  # a fresh namespace: nothing else listens there
                        "RANK": str(rank),
                        "WORLD_SIZE": str(world),
                        "LOCAL_RANK": str(rank % per_host),
                        "LOCAL_WORLD_SIZE": str(per_host),
                        "GLOO_SOCKET_IFNAME": host.interface,
                        KEY_ENV: key,
                    }
                )
            _netns.run_workers(commands, envs, timeout=args.netns_timeout, log_dir=Path(tmp))
            result = json.loads(out.read_text())
    except _netns.NetnsUnavailable as error:
        return {"skipped": str(error)}
    blocks = {name: block_medians(runs, args.repeats) for name, runs in result["times"].items()}
    rows = []
    for name, medians in blocks.items():
        row = summarize(name, medians, blocks[DDP])
        row["samples_per_s"] = NETNS_BATCH / (row["step_ms"] / 1000)
        row["speedup"] = median_and_range(
            [d / m for d, m in zip(blocks[DDP], medians, strict=True)]
        )
        row["link_mb_per_step"] = statistics.median(result["sent"][name]) / 1e6
        rows.append(row)
    params = sum(p.numel() for p in wide_model(args.layers).parameters())
    return {
        "setup": f"2 namespaces x 2 processes x 1 thread, veth capped by tbf at {args.rate} "
        f"each way, gloo, global batch {NETNS_BATCH}, SGD",
        "model": f"{args.layers} x Linear({WIDTH}, {WIDTH}), {params} params",
        "link_mb_per_step": "bytes host 0 sent through its capped veth end per step (median)",
        "rows": rows,
    }


def worker_argv(args: argparse.Namespace, out: Path) -> list[str]:
    return [
        "--worker",
        "--out",
        str(out),
        "--layers",
        str(args.layers),
        "--rounds",
        str(args.rounds),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
    ]


# --- figures -----------------------------------------------------------------------------------


def block_medians(times: list[float], blocks: int) -> list[float]:
    size = len(times) // blocks
    return [statistics.median(times[i * size : (i + 1) * size]) for i in range(blocks)]


def median_and_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(name: str, medians: list[float], ddp: list[float]) -> dict[str, Any]:
    return {
        "variant": name,
        "step_ms": 1000 * statistics.median(medians),
        "block_medians_ms": [1000 * m for m in medians],
        "vs_ddp": median_and_range([m / d for m, d in zip(medians, ddp, strict=True)]),
    }


def print_table(title: str, result: dict[str, Any], extra: dict[str, str]) -> None:
    print(f"\n== {title}")
    if "skipped" in result:
        print(f"skipped: {result['skipped']}")
        return
    print(f"{result['setup']}; {result['model']}")
    header = f"{'variant':42s} {'step ms':>8s} {'blocks (ms)':>22s} {'vs DDP':>14s}"
    print(header + "".join(f" {label:>16s}" for label in extra))
    for row in result["rows"]:
        blocks = ", ".join(f"{m:.0f}" for m in row["block_medians_ms"])
        line = f"{row['variant']:42s} {row['step_ms']:8.1f} {blocks:>22s} {fmt(row['vs_ddp']):>14s}"
        for key in extra.values():
            value = row.get(key)
            line += f" {'' if value is None else fmt(value):>16s}"
        print(line)


def fmt(value: float | dict[str, float]) -> str:
    if isinstance(value, dict):
        return f"{value['median']:.3f} ({value['min']:.2f}-{value['max']:.2f})"
    return f"{value:.1f}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=["loopback", "netns", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per block")
    parser.add_argument("--repeats", type=int, default=3, help="blocks of rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2, help="netns: 4096x4096 layers")
    parser.add_argument("--rate", default="1gbit", help="netns: tbf rate each way")
    parser.add_argument("--netns-timeout", type=float, default=1200)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        netns_worker(args)
        return
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_average_before": os.getloadavg(),
        },
    }
    if args.scenario in ("loopback", "all"):
        loopback_args = argparse.Namespace(**{**vars(args), "rounds": args.rounds or 20})
        report["loopback"] = run_loopback(loopback_args)
        print_table("loopback", report["loopback"], {"efficiency": "efficiency"})
    if args.scenario in ("netns", "all"):
        netns_args = argparse.Namespace(**{**vars(args), "rounds": args.rounds or 4})
        report["netns"] = run_netns(netns_args)
        columns = {
            "samples/s": "samples_per_s",
            "speedup": "speedup",
            "MB/step": "link_mb_per_step",
        }
        print_table("netns", report["netns"], columns)
    report["machine"]["load_average_after"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

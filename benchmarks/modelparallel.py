"""dtrain's pipeline against torch.distributed.pipelining, and auto-partition against an even split.

Scenarios (each prints a table; ``--json`` writes every figure):

* ``pipeline``: the 4-layer transformer LM of the data-parallel benchmark, 2 partitions
  (embeddings + 2 blocks | 2 blocks + head), global batch 16 in 8 microbatches, AdamW, gloo,
  one thread per rank. In one 2-process world, dtrain (``interleaved``) and ``Schedule1F1B`` on
  the same split take turns step by step; the ratio is of the median steps, and the median of
  each step pair's ratio is shown too. Each rank also times its stage alone (the same
  microbatches, forward + backward, then its optimizer step), which gives the ideal pipelined
  step ``max over stages of compute × (m + p − 1) / m + optimizer``.
* ``unbalanced``: an 8-layer LM with a large vocabulary (a heavy head), auto-partition against
  the equal-layer split (4 blocks each side, embeddings first, head last), each in fresh
  2-process worlds, alternating.
* ``memory``: per-rank parameter, gradient and optimizer bytes and peak RSS of the pipeline
  against one process training the whole model.

A step's time is the slowest rank's; variants report the median step.

    python benchmarks/modelparallel.py --scenario all --json out/mp.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _lm import FirstStage, LastStage, TransformerLM, lm_loss  # benchmarks/ is the script's dir
from torch import nn

import dtrain.modelparallel as smp

GLOBAL_BATCH, SEQ = 16, 128
STAGES = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def batches(count: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    data = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        data.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return data


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def timed_steps(
    step: Callable[[int], None], count: int, warmup: int, start: int = 0
) -> list[float]:
    """Each step's time on the slowest rank (``step`` gets the step's index from ``start``)."""
    times = []
    for index in range(start, start + warmup + count):
        dist.barrier()
        began = time.perf_counter()
        step(index)
        elapsed = slowest(time.perf_counter() - began)
        if index >= start + warmup:
            times.append(elapsed)
    return times


def alternated_steps(
    first: Callable[[int], None], second: Callable[[int], None], count: int, warmup: int
) -> tuple[list[float], list[float]]:
    """Step times of two variants taking turns step by step (which goes first alternates too),
    so that the machine's drift, often 20% within a minute here, hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for index in range(warmup + count):
        order = (0, 1) if index % 2 == 0 else (1, 0)
        for which in order:
            elapsed = timed_steps((first, second)[which], 1, 0, start=index)[0]
            if index >= warmup:
                times[which].append(elapsed)
    return times


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        tensor_bytes(v for v in s.values() if isinstance(v, torch.Tensor))
        for s in optimizer.state.values()
    )


def init_world(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def smp_config(microbatches: int, auto: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "pipeline_parallel_degree": STAGES,
        "microbatches": microbatches,
        "pipeline": "interleaved",
        "optimize": "speed",
        "memory_weight": 0.2,
        "auto_partition": auto,
    }
    if not auto:
        config["default_partition"] = 0
    return config


def equal_split(model: TransformerLM) -> None:
    """Second half of the blocks and the head on partition 1 (the rest stays on 0)."""
    half = len(model.blocks) // 2
    for block in model.blocks[half:]:
        smp.set_partition(block, 1)
    smp.set_partition(model.head, 1)


def dtrain_pipeline(
    model: TransformerLM, microbatches: int
) -> tuple[Callable[[int, list[Any]], None], smp.DistributedModel, torch.optim.Optimizer]:
    dist_model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(dist_model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model: smp.DistributedModel, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        loss = model(tokens, targets)
        model.backward(loss)
        return loss

    def step(index: int, data: list[Any]) -> None:
        optimizer.zero_grad(set_to_none=True)
        train_step(dist_model, *data[index % len(data)])
        optimizer.step()

    return step, dist_model, optimizer


# --- scenario: pipeline ------------------------------------------------------------------------


def pipeline_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    init_world(rank, STAGES, port)
    m = args.microbatches
    data = batches(4, 1024)
    smp.init(smp_config(m, auto=False))
    ours_model = TransformerLM(seed=0)
    equal_split(ours_model)
    ours_step, _, _ = dtrain_pipeline(ours_model, m)

    theirs_model = TransformerLM(seed=0)
    split = len(theirs_model.blocks) // 2
    stage_module: nn.Module = (
        FirstStage(theirs_model, split) if rank == 0 else LastStage(theirs_model, split)
    )
    stage = PipelineStage(stage_module, rank, STAGES, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lm_loss)
    theirs_opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)

    def theirs_step(index: int) -> None:
        tokens, targets = data[index % len(data)]
        theirs_opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=[])
        theirs_opt.step()

    def stage_alone() -> tuple[float, float]:
        """This rank's stage over the step's microbatches, alone: compute, optimizer seconds."""
        tokens, targets = data[0]
        start = time.perf_counter()
        for piece, target in zip(tokens.chunk(m), targets.chunk(m), strict=True):
            if rank == 0:
                out = stage_module(piece)
                out.backward(torch.ones_like(out))
            else:
                hidden = torch.randn(piece.shape[0], SEQ, 256, requires_grad=True)
                lm_loss(stage_module(hidden), target).backward()
        compute = time.perf_counter() - start
        start = time.perf_counter()
        theirs_opt.step()
        theirs_opt.zero_grad(set_to_none=True)
        return compute, time.perf_counter() - start

    ours: list[float] = []
    theirs: list[float] = []
    alone: list[tuple[float, float]] = []
    for _ in range(args.repeats):
        mine, other = alternated_steps(
            lambda i: ours_step(i, data), theirs_step, args.steps, args.warmup
        )
        ours += mine
        theirs += other
        dist.barrier()
        alone.append(stage_alone())
    compute = statistics.median(c for c, _ in alone)
    opt_time = statistics.median(o for _, o in alone)
    stage_times: list[Any] = [None] * STAGES
    dist.all_gather_object(stage_times, (compute, opt_time))
    if rank == 0:
        results.put({"ours": ours, "theirs": theirs, "stages": stage_times})
    smp.shutdown()
    dist.destroy_process_group()


def run_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    raw = spawn(pipeline_worker, STAGES, args)
    m = args.microbatches
    ours, theirs = statistics.median(raw["ours"]), statistics.median(raw["theirs"])
    pairs = [a / b for a, b in zip(raw["ours"], raw["theirs"], strict=True)]
    ideal = max(c * (m + STAGES - 1) / m + o for c, o in raw["stages"])
    return {
        "microbatches": m,
        "dtrain_interleaved_ms": ours * 1e3,
        "torch_1f1b_ms": theirs * 1e3,
        "ratio_dtrain_over_torch": ours / theirs,
        "median_step_pair_ratio": statistics.median(pairs),
        "stage_compute_ms": [c * 1e3 for c, _ in raw["stages"]],
        "stage_optimizer_ms": [o * 1e3 for _, o in raw["stages"]],
        "ideal_ms": ideal * 1e3,
        "dtrain_over_ideal": ours / ideal,
        "torch_over_ideal": theirs / ideal,
        "steps_per_variant": len(raw["ours"]),
    }


# --- scenario: unbalanced ----------------------------------------------------------------------

UNBALANCED = {"vocab": 16384, "layers": 8}


def unbalanced_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    init_world(rank, STAGES, port)
    auto = args.variant == "auto"
    smp.init(smp_config(args.microbatches, auto=auto))
    model = TransformerLM(seed=0, **UNBALANCED)
    if not auto:
        equal_split(model)
    step, dist_model, _ = dtrain_pipeline(model, args.microbatches)
    data = batches(4, UNBALANCED["vocab"])
    times = timed_steps(lambda i: step(i, data), args.steps, args.warmup)
    if rank == 0:
        plan = dist_model.partition_plan()
        results.put({"times": times, "plan": plan.table()})
    smp.shutdown()
    dist.destroy_process_group()


def run_unbalanced(args: argparse.Namespace) -> dict[str, Any]:
    times: dict[str, list[float]] = {"auto": [], "equal": []}
    plan = ""
    for _ in range(args.repeats):
        for variant in ("auto", "equal"):
            raw = spawn(
                unbalanced_worker, STAGES, argparse.Namespace(**vars(args), variant=variant)
            )
            times[variant] += raw["times"]
            plan = raw["plan"] if variant == "auto" else plan
    auto, equal = statistics.median(times["auto"]), statistics.median(times["equal"])
    return {
        "model": UNBALANCED,
        "auto_ms": auto * 1e3,
        "equal_layers_ms": equal * 1e3,
        "speedup_auto_over_equal": equal / auto,
        "auto_plan": plan,
    }


# --- scenario: memory --------------------------------------------------------------------------


def memory_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    world = 1 if args.variant == "single" else STAGES
    init_world(rank, world, port)
    data = batches(2, 1024)
    model = TransformerLM(seed=0)
    if args.variant == "single":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for tokens, targets in data:
            optimizer.zero_grad(set_to_none=True)
            model(tokens, targets).backward()
            optimizer.step()
        params = list(model.parameters())
    else:
        smp.init(smp_config(args.microbatches, auto=False))
        equal_split(model)
        step, dist_model, optimizer = dtrain_pipeline(model, args.microbatches)
        for index in range(len(data)):
            step(index, data)
        params = list(dist_model.local_parameters())
    row = {
        "rank": rank,
        "parameter_bytes": tensor_bytes(params),
        "gradient_bytes": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_bytes": optimizer_bytes(optimizer),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        results.put(rows)
    if args.variant != "single":
        smp.shutdown()
    dist.destroy_process_group()


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    single = spawn(memory_worker, 1, argparse.Namespace(**vars(args), variant="single"))
    pipeline = spawn(memory_worker, STAGES, argparse.Namespace(**vars(args), variant="pipeline"))
    return {"single_process": single, "pipeline_ranks": pipeline}


# --- tables ------------------------------------------------------------------------------------


def pipeline_table(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"pipeline: 2 partitions, {r['microbatches']} microbatches, median step "
            f"({r['steps_per_variant']} steps each)",
            f"  dtrain interleaved   {r['dtrain_interleaved_ms']:8.1f} ms",
            f"  torch Schedule1F1B   {r['torch_1f1b_ms']:8.1f} ms",
            f"  ratio dtrain/torch   {r['ratio_dtrain_over_torch']:8.3f}   (target <= 1.0)",
            f"  per step pair, median{r['median_step_pair_ratio']:8.3f}",
            f"  ideal (stages alone) {r['ideal_ms']:8.1f} ms",
            f"  dtrain/ideal         {r['dtrain_over_ideal']:8.3f}   (target <= 1.10)",
            f"  torch/ideal          {r['torch_over_ideal']:8.3f}",
        ]
    )


def unbalanced_table(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"unbalanced LM {r['model']}: auto-partition vs equal layers",
            f"  auto       {r['auto_ms']:8.1f} ms",
            f"  equal      {r['equal_layers_ms']:8.1f} ms",
            f"  speedup    {r['speedup_auto_over_equal']:8.3f}   (target >= 1.2)",
        ]
    )


def memory_table(r: dict[str, Any]) -> str:
    lines = ["memory per rank: params / grads / optimizer MiB, peak RSS MiB"]
    rows = [("single", row) for row in r["single_process"]]
    rows += [(f"pp rank {row['rank']}", row) for row in r["pipeline_ranks"]]
    for label, row in rows:
        mib = [row[k] / 2**20 for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")]
        lines.append(
            f"  {label:10} {mib[0]:7.1f} {mib[1]:7.1f} {mib[2]:7.1f}   {row['peak_rss_mib']:7.1f}"
        )
    return "\n".join(lines)


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "pipeline": pipeline_table,
    "unbalanced": unbalanced_table,
    "memory": memory_table,
}


# --- running -----------------------------------------------------------------------------------


def spawn(worker: Callable[..., None], world: int, args: argparse.Namespace) -> Any:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=worker, args=(rank, port, args, results)) for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        result = results.get(timeout=args.timeout)
        for process in processes:
            process.join(args.timeout)
        failed = [p.exitcode for p in processes if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"benchmark workers failed with exit codes {failed}")
        return result
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario", choices=("pipeline", "unbalanced", "memory", "all"), default="all"
    )
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    chosen = ("pipeline", "unbalanced", "memory") if args.scenario == "all" else (args.scenario,)
    runners = {"pipeline": run_pipeline, "unbalanced": run_unbalanced, "memory": run_memory}
    report: dict[str, Any] = {"torch": torch.__version__, "cpus": os.cpu_count()}
    for name in chosen:
        report[name] = runners[name](args)
        print(TABLES[name](report[name]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

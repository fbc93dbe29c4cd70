"""dtrain's pipeline against torch.distributed.pipelining, and auto-partition against an even split.

Scenarios (each prints a table; ``--json`` writes every figure):

* ``pipeline``: the 4-layer transformer LM of the data-parallel benchmark, 2 partitions
  (embeddings + 2 blocks | 2 blocks + head), global batch 16 in 8 microbatches, AdamW, gloo,
  one thread per rank. In one 2-process world, dtrain (``interleaved``, its zero-bubble drain
  as planned) and torch's ``Schedule1F1B`` and ``ScheduleInterleavedZeroBubble`` (one stage per
  rank) on the same split, and torch's ``ScheduleZBVZeroBubble`` (its zero-bubble schedule for
  2 ranks, which needs two stages per rank: embeddings + block 0 and block 3 + head on rank 0,
  blocks 1 and 2 on rank 1), take turns step by step; ratios are of the median steps against
  ``Schedule1F1B``, and the median of each step pair's ratio is shown too. Each rank also
  times its stage alone (the same microbatches, forward + backward, then its optimizer step),
  which gives the ideal 1F1B step ``max over stages of compute × (m + p − 1) / m + optimizer``
  and what dtrain's planner predicts for its plan against a 1F1B plan with those stage times.
  ``--pin-cores`` puts rank r on CPU r (both libraries alike); ``--deterministic`` runs
  dtrain's variant with ``deterministic_server`` (every rank in its plan row's order).
* ``worlds``: dtrain (``interleaved``, manual split as in ``pipeline``) against torch's
  ``Schedule1F1B`` with each library in 2-process worlds of its own, as their users run them:
  torch's ranks never see dtrain's heap setting (``smp.init``'s, which the ``pipeline``
  scenario's shared processes give torch too). ``--shape`` picks the LM: ``lm4`` (the pipeline
  scenario's), ``lm8`` (8 blocks of d_model 256) or ``gpt2s`` (a GPT-2-small-like stack: 12
  blocks of d_model 768, 12 heads, vocabulary 8192, sequence 128). ``--repeats`` rounds, each
  four fresh worlds in ABBA order (dtrain, torch, torch, dtrain; fresh worlds differ by several
  percent in compute alone here), each world ``--warmup`` + ``--steps`` steps; a round's ratio
  is dtrain's median step over torch's, and the figure is the median of the rounds' ratios.
  Cores are not pinned.
* ``unbalanced``: an 8-layer LM with a large vocabulary (a heavy head), auto-partition against
  the equal-layer split (4 blocks each side, embeddings first, head last), each in fresh
  2-process worlds, alternating.
* ``memory``: per-rank parameter, gradient and optimizer bytes and peak RSS of the pipeline
  against one process training the whole model.
* ``busy``: a 30M-parameter GPT-2 (``examples/modelparallel/gpt.py``: 8 layers, width 512,
  8 heads, sequence 128, vocabulary 8192, its head tied to the embedding), global batch 16 in
  8 microbatches, auto-partitioned on 2 ranks: the share of each step each rank computes
  (its timeline's periods over the step), with the zero-bubble drain, in fresh worlds; beside
  it, what the plan predicts and the most a rank can be busy given the partitions' work (its
  own over the slowest's).

A step's time is the slowest rank's; variants report the median step.

    python benchmarks/modelparallel.py --scenario all --json out/mp.json
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _lm import (  # benchmarks/ is the script's dir
    FirstStage,
    LastStage,
    MiddleStage,
    TransformerLM,
    lm_loss,
)
from _scenarios import run_scenarios
from torch import nn

import dtrain.modelparallel as smp
from dtrain.jobkey import KEY_ENV
from dtrain.modelparallel.scheduling.costs import Costs
from dtrain.modelparallel.scheduling.planner import SPLIT_OVERHEAD, build_schedule
from dtrain.modelparallel.scheduling.schedule import simulate

GLOBAL_BATCH, SEQ = 16, 128
STAGES = 2
SHAPES: dict[str, dict[str, int]] = {
    "lm4": {},  # the LM's defaults: 4 blocks of d_model 256, vocabulary 1024
    "lm8": {"layers": 8},
    "gpt2s": {"layers": 12, "d_model": 768, "heads": 12, "ff": 3072, "vocab": 8192},
}


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
    variants: list[Callable[[int], None]], count: int, warmup: int
) -> list[list[float]]:
    """Step times of the variants taking turns step by step (which goes first rotates too),
    so that the machine's drift, often 20% within a minute here, hits all alike."""
    times: list[list[float]] = [[] for _ in variants]
    for index in range(warmup + count):
        shift = index % len(variants)
        for which in [*range(shift, len(variants)), *range(shift)]:
            elapsed = timed_steps(variants[which], 1, 0, start=index)[0]
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


def init_world(rank: int, world: int, port: int, pin: bool = False, join: bool = True) -> None:
    """The launcher's environment, as torchrun gives it, and the world joined; without ``join``
    left to ``smp.init``, as in a job (which sets the heap before the world's threads start)."""
    if pin:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if join:
        dist.init_process_group("gloo", rank=rank, world_size=world)


def smp_config(microbatches: int, auto: bool, deterministic: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {
        "pipeline_parallel_degree": STAGES,
        "microbatches": microbatches,
        "pipeline": "interleaved",
        "optimize": "speed",
        "memory_weight": 0.2,
        "auto_partition": auto,
        "deterministic_server": deterministic,
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


TORCH_SCHEDULES = ("torch 1F1B", "torch ZB1P", "torch ZBV")


def torch_pipeline(
    name: str, rank: int, m: int, shape: dict[str, int] | None = None
) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], list[nn.Module]]:
    """One of torch's schedules on a fresh copy of the LM (of ``shape``, the LM's defaults
    unless given): its step, and this rank's stages."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    model = TransformerLM(seed=0, **(shape or {}))
    cpu = torch.device("cpu")
    if name == "torch ZBV":  # a V over 4 stages: rank 0 runs 0 and 3, rank 1 runs 1 and 2
        placed: list[tuple[int, nn.Module]] = (
            [(0, FirstStage(model, 1)), (3, LastStage(model, 3))]
            if rank == 0
            else [(1, MiddleStage(model, 1, 2)), (2, MiddleStage(model, 2, 3))]
        )
        stages = [PipelineStage(module, index, 4, cpu) for index, module in placed]
        schedule: Any = ScheduleZBVZeroBubble(stages, n_microbatches=m, loss_fn=lm_loss)
        modules = [module for _, module in placed]

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            if rank == 0:
                schedule.step(tokens, target=targets, losses=[])
            else:
                schedule.step()

        return step, modules
    split = len(model.blocks) // 2
    module: nn.Module = FirstStage(model, split) if rank == 0 else LastStage(model, split)
    stage = PipelineStage(module, rank, STAGES, cpu)
    if name == "torch 1F1B":
        schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lm_loss)
    else:
        schedule = ScheduleInterleavedZeroBubble([stage], n_microbatches=m, loss_fn=lm_loss)

    def single(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=[])

    return single, [module]


def pipeline_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    init_world(rank, STAGES, port, args.pin_cores)
    m = args.microbatches
    data = batches(4, 1024)
    smp.init(smp_config(m, auto=False, deterministic=args.deterministic))
    ours_model = TransformerLM(seed=0)
    equal_split(ours_model)
    ours_step, ours_dist, _ = dtrain_pipeline(ours_model, m)
    variants: list[Callable[[int], None]] = [lambda i: ours_step(i, data)]
    stage_module: nn.Module | None = None
    for name in TORCH_SCHEDULES:
        step_fn, modules = torch_pipeline(name, rank, m)
        optimizer = torch.optim.AdamW([p for mod in modules for p in mod.parameters()], lr=1e-4)
        if name == "torch 1F1B":
            stage_module = modules[0]  # the split's stage, timed alone below

        def theirs_step(index: int, step_fn: Any = step_fn, optimizer: Any = optimizer) -> None:
            optimizer.zero_grad(set_to_none=True)
            step_fn(*data[index % len(data)])
            optimizer.step()

        variants.append(theirs_step)
    assert stage_module is not None
    stage_opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)

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
        stage_opt.step()
        stage_opt.zero_grad(set_to_none=True)
        return compute, time.perf_counter() - start

    times: list[list[float]] = [[] for _ in variants]
    alone: list[tuple[float, float]] = []
    for _ in range(args.repeats):
        measured = alternated_steps(variants, args.steps, args.warmup)
        for kept, new in zip(times, measured, strict=True):
            kept += new
        dist.barrier()
        alone.append(stage_alone())
    compute = statistics.median(c for c, _ in alone)
    opt_time = statistics.median(o for _, o in alone)
    stage_times: list[Any] = [None] * STAGES
    dist.all_gather_object(stage_times, (compute, opt_time))
    if rank == 0:
        split = ours_dist.pipeline_schedule().policy.split
        results.put({"times": times, "stages": stage_times, "split": split})
    smp.shutdown()
    dist.destroy_process_group()


def planned_ratio(stage_compute: list[float], optimizer: float, m: int) -> dict[str, Any]:
    """What dtrain's planner predicts for its plan against a 1F1B plan (no split) with the
    measured stage times (a stage's forward a third of its compute) and the split cost."""
    costs = Costs.of_stages([c / m for c in stage_compute], SPLIT_OVERHEAD)
    ours = build_schedule("interleaved", STAGES, m, costs=costs)
    whole = build_schedule("interleaved", STAGES, m, split_backward=False, costs=costs)
    free = Costs.of_stages([c / m for c in stage_compute])
    free_plan = build_schedule("interleaved", STAGES, m, costs=free)
    return {
        "split": list(ours.policy.split),
        "planned_over_1f1b": (simulate(ours, costs).makespan + optimizer)
        / (simulate(whole, costs).makespan + optimizer),
        "free_split_over_1f1b": (simulate(free_plan, free).makespan + optimizer)
        / (simulate(whole, free).makespan + optimizer),
    }


def run_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    raw = spawn(pipeline_worker, STAGES, args)
    m = args.microbatches
    names = ["dtrain", *TORCH_SCHEDULES]
    times = dict(zip(names, raw["times"], strict=True))
    base = times["torch 1F1B"]
    medians = {name: statistics.median(t) for name, t in times.items()}
    ideal = max(c * (m + STAGES - 1) / m + o for c, o in raw["stages"])
    return {
        "microbatches": m,
        "pinned": args.pin_cores,
        "deterministic": args.deterministic,
        "median_ms": {name: value * 1e3 for name, value in medians.items()},
        "over_torch_1f1b": {name: value / medians["torch 1F1B"] for name, value in medians.items()},
        "pair_median_over_torch_1f1b": {
            name: statistics.median(a / b for a, b in zip(t, base, strict=True))
            for name, t in times.items()
        },
        "dtrain_split": list(raw["split"]),
        "stage_compute_ms": [c * 1e3 for c, _ in raw["stages"]],
        "stage_optimizer_ms": [o * 1e3 for _, o in raw["stages"]],
        "ideal_1f1b_ms": ideal * 1e3,
        "dtrain_over_ideal": medians["dtrain"] / ideal,
        "torch_1f1b_over_ideal": medians["torch 1F1B"] / ideal,
        "plan": planned_ratio([c for c, _ in raw["stages"]], max(o for _, o in raw["stages"]), m),
        "steps_per_variant": len(base),
    }


# --- scenario: worlds --------------------------------------------------------------------------


def worlds_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """One library's steps in a world of its own: dtrain through ``smp.init`` (its heap setting
    included), torch's ``Schedule1F1B`` in plain processes."""
    init_world(rank, STAGES, port, join=args.variant != "dtrain")
    m, shape = args.microbatches, SHAPES[args.shape]
    data = batches(4, shape.get("vocab", 1024))
    if args.variant == "dtrain":
        smp.init(smp_config(m, auto=False))
        model = TransformerLM(seed=0, **shape)
        equal_split(model)
        ours, _, _ = dtrain_pipeline(model, m)
        step: Callable[[int], None] = lambda index: ours(index, data)  # noqa: E731
    else:
        theirs, modules = torch_pipeline("torch 1F1B", rank, m, shape)
        optimizer = torch.optim.AdamW(modules[0].parameters(), lr=1e-4)

        def step(index: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            theirs(*data[index % len(data)])
            optimizer.step()

    rows = [measured_step(step, index) for index in range(args.warmup + args.steps)]
    ranks: list[Any] = [None] * STAGES
    dist.all_gather_object(ranks, rows[args.warmup :])
    leave_world(results, ranks if rank == 0 else None)


def measured_step(step: Callable[[int], None], index: int) -> tuple[float, float, int]:
    """One step: its time on the slowest rank, this rank's CPU seconds (every thread, user and
    system) and minor page faults, which a loaded machine inflates less than wall time."""
    dist.barrier()
    before, began = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    step(index)
    elapsed, after = slowest(time.perf_counter() - began), resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return elapsed, cpu, after.ru_minflt - before.ru_minflt


def run_worlds(args: argparse.Namespace) -> dict[str, Any]:
    rounds = []
    for _ in range(args.repeats):
        turns: dict[str, list[Any]] = {"dtrain": [], "torch": []}
        for variant in ("dtrain", "torch", "torch", "dtrain"):
            turn = argparse.Namespace(**vars(args), variant=variant)
            turns[variant].append(spawn(worlds_worker, STAGES, turn))
        figures = {variant: world_figures(worlds) for variant, worlds in turns.items()}
        ours, theirs = figures["dtrain"], figures["torch"]
        rounds.append(
            {
                "dtrain": ours,
                "torch": theirs,
                "ratio": ours["step_ms"] / theirs["step_ms"],
                "cpu_ratio": ours["cpu_ms"] / theirs["cpu_ms"],
            }
        )
    return {
        "shape": args.shape,
        "model": SHAPES[args.shape],
        "microbatches": args.microbatches,
        "steps_per_world": args.steps,
        "rounds": rounds,
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "cpu_ratio": statistics.median(r["cpu_ratio"] for r in rounds),
    }


def world_figures(worlds: list[list[list[tuple[float, float, int]]]]) -> dict[str, float]:
    """One library's turns of a round (each a world's ranks' rows of :func:`measured_step`):
    the median step, and the median per step of CPU time and page faults summed over ranks."""
    steps = [
        (rows[0][0], sum(row[1] for row in rows), sum(row[2] for row in rows))
        for ranks in worlds
        for rows in zip(*ranks, strict=True)
    ]
    return {
        "step_ms": statistics.median(s[0] for s in steps) * 1e3,
        "cpu_ms": statistics.median(s[1] for s in steps) * 1e3,
        "faults": statistics.median(s[2] for s in steps),
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


# --- scenario: busy ----------------------------------------------------------------------------

GPT_30M = {"layers": 8, "dim": 512, "heads": 8, "max_length": 128, "vocab_size": 8192}


def busy_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "modelparallel"))
    from gpt import build_model

    init_world(rank, STAGES, port, args.pin_cores)
    smp.init(smp_config(args.microbatches, auto=True))
    model = smp.DistributedModel(build_model(dropout=0.0, **GPT_30M))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model: smp.DistributedModel, ids: torch.Tensor) -> Any:
        loss = model(ids, labels=ids)
        model.backward(loss)
        return loss

    generator = torch.Generator().manual_seed(0)
    data = [
        torch.randint(GPT_30M["vocab_size"], (GLOBAL_BATCH, SEQ), generator=generator)
        for _ in range(4)
    ]
    steps, busy = [], []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        train_step(model, data[index % len(data)])
        optimizer.step()
        elapsed = slowest(time.perf_counter() - began)
        if index >= args.warmup:
            steps.append(elapsed)
            busy.append(sum(event.duration for event in model.timeline()))
    shares: list[Any] = [None] * STAGES
    dist.all_gather_object(shares, [b / s for b, s in zip(busy, steps, strict=True)])
    if rank == 0:
        plan = model.partition_plan()
        schedule = model.pipeline_schedule()
        costs = Costs.of_stages([stage.compute_time for stage in plan.stages], SPLIT_OVERHEAD)
        planned = simulate(schedule, costs)
        results.put(
            {
                "steps": steps,
                "busy": shares,
                "params": sum(p.numel() for p in build_model(**GPT_30M).parameters()),
                "split": list(schedule.policy.split),
                "planned_busy": [b / planned.makespan for b in planned.busy],
                "stage_compute_ms": [stage.compute_time * 1e3 for stage in plan.stages],
            }
        )
    smp.shutdown()
    dist.destroy_process_group()


def run_busy(args: argparse.Namespace) -> dict[str, Any]:
    raw: dict[str, list[Any]] = {"split": []}
    for _ in range(args.repeats):
        raw["split"].append(spawn(busy_worker, STAGES, args))
    report: dict[str, Any] = {"model": GPT_30M, "params": raw["split"][0]["params"]}
    for variant, runs in raw.items():
        report[variant] = {
            "step_ms": statistics.median(s for run in runs for s in run["steps"]) * 1e3,
            "busy": [
                statistics.median(share for run in runs for share in run["busy"][rank])
                for rank in range(STAGES)
            ],
            "split": runs[0]["split"],
            "planned_busy": runs[0]["planned_busy"],
        }
    compute = raw["split"][0]["stage_compute_ms"]
    report["stage_compute_ms"] = compute
    report["work_bound"] = [c / max(compute) for c in compute]
    return report


# --- tables ------------------------------------------------------------------------------------


def pipeline_table(r: dict[str, Any]) -> str:
    pinned = ", one CPU per rank" if r["pinned"] else ""
    pinned += ", dtrain with deterministic_server" if r["deterministic"] else ""
    lines = [
        f"pipeline: 2 partitions, {r['microbatches']} microbatches{pinned}, median step "
        f"({r['steps_per_variant']} steps each); ratios against torch Schedule1F1B",
        f"  {'':22} {'ms':>8} {'ratio':>7} {'pairs':>7}",
    ]
    for name, ms in r["median_ms"].items():
        ratio = r["over_torch_1f1b"][name]
        pair = r["pair_median_over_torch_1f1b"][name]
        lines.append(f"  {name:22} {ms:8.1f} {ratio:7.3f} {pair:7.3f}")
    plan = r["plan"]
    lines += [
        f"  dtrain splits per stage {r['dtrain_split']} (plan for the measured stages: "
        f"{plan['split']})",
        f"  planned: dtrain / 1F1B {plan['planned_over_1f1b']:.3f} "
        f"(with free splits: {plan['free_split_over_1f1b']:.3f})",
        f"  ideal 1F1B (stages alone) {r['ideal_1f1b_ms']:.1f} ms; dtrain/ideal "
        f"{r['dtrain_over_ideal']:.3f}, torch 1F1B/ideal {r['torch_1f1b_over_ideal']:.3f}",
    ]
    return "\n".join(lines)


def worlds_table(r: dict[str, Any]) -> str:
    lines = [
        f"worlds: {r['shape']} {r['model'] or '(defaults)'}, 2 partitions, {r['microbatches']} "
        f"microbatches, each library in its own worlds, ABBA rounds of {r['steps_per_world']} "
        "steps a world, not pinned; per step: median step, CPU ms and page faults of both ranks",
        f"  {'round':>5} {'dtrain ms':>10} {'torch ms':>10} {'ratio':>7}   {'dtrain CPU':>10}"
        f" {'torch CPU':>10} {'ratio':>7}   {'dtrain faults':>13} {'torch faults':>12}",
    ]
    for index, row in enumerate(r["rounds"], 1):
        ours, theirs = row["dtrain"], row["torch"]
        lines.append(
            f"  {index:5} {ours['step_ms']:10.1f} {theirs['step_ms']:10.1f} {row['ratio']:7.3f}"
            f"   {ours['cpu_ms']:10.1f} {theirs['cpu_ms']:10.1f} {row['cpu_ratio']:7.3f}"
            f"   {ours['faults']:13.0f} {theirs['faults']:12.0f}"
        )
    lines.append(
        f"  dtrain / torch Schedule1F1B, median of the rounds: step {r['ratio']:.3f}, "
        f"CPU {r['cpu_ratio']:.3f}"
    )
    return "\n".join(lines)


def busy_table(r: dict[str, Any]) -> str:
    lines = [
        f"busy: GPT-2 {r['params'] / 1e6:.1f}M parameters {r['model']}, share of the step each "
        "rank computes (median)",
        f"  {'':20} {'step ms':>8} {'rank 0':>7} {'rank 1':>7}   planned      split",
    ]
    row = r["split"]
    planned = " ".join(f"{b:.2f}" for b in row["planned_busy"])
    lines.append(
        f"  {'zero-bubble drain':20} {row['step_ms']:8.1f} {row['busy'][0]:7.3f} "
        f"{row['busy'][1]:7.3f}   {planned}   {row['split']}"
    )
    bound = " ".join(f"{b:.3f}" for b in r["work_bound"])
    lines.append(f"  most a rank can be busy (its work over the slowest's): {bound}")
    return "\n".join(lines)


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
    "worlds": worlds_table,
    "unbalanced": unbalanced_table,
    "memory": memory_table,
    "busy": busy_table,
}


# --- running -----------------------------------------------------------------------------------


def leave_world(results: Any, result: Any | None) -> None:
    """End a worker of :func:`spawn`: deliver ``result`` (rank 0's; ``None`` on the others),
    close the model-parallel state and the world, and leave as dtrain's rank runner does
    (:mod:`dtrain.launch.entry`): the interpreter's teardown, where gloo's threads may abort the
    process (once in a few runs here), never runs."""
    if result is not None:
        results.put(result)
        results.close()
        results.join_thread()  # delivered before this process leaves
    if smp.is_initialized():
        smp.shutdown()  # and the world, where smp.init joined it
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker: Callable[..., None], world: int, args: argparse.Namespace) -> Any:
    """Rank 0's result of ``worker`` on a fresh world; a worker that dies fails it at once."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    os.environ[KEY_ENV] = os.urandom(32).hex()  # the ranks' key, as dtrain run's agents give it
    processes = [
        context.Process(target=worker, args=(rank, port, args, results)) for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                result = results.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"exit codes {dead}" if dead else f"no result in {args.timeout:g} s"
                    raise RuntimeError(f"benchmark workers failed: {why}") from None
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
        "--scenario",
        choices=("pipeline", "worlds", "unbalanced", "memory", "busy", "all"),
        default="all",
    )
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="lm4", help="worlds' LM")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--pin-cores", action="store_true", help="rank r on CPU r")
    parser.add_argument(
        "--deterministic", action="store_true", help="dtrain with deterministic_server"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runners = {
        "pipeline": run_pipeline,
        "worlds": run_worlds,
        "unbalanced": run_unbalanced,
        "memory": run_memory,
        "busy": run_busy,
    }
    run_scenarios(args, runners, TABLES)


if __name__ == "__main__":
    main()

"""Models bigger than one process: memory per rank and speed of delayed initialisation.

Scenarios (each prints a table; ``--json`` writes every figure):

* ``memory``: the 218M-parameter LM (16 pre-norm blocks of width 1024, vocabulary 8192,
  sequence 128), AdamW, 2 steps on a global batch of 8 in 4 microbatches, auto-partitioned for
  memory (``optimize: memory``, SMP's memory weight 0.8). Peak RSS of each rank
  (``ru_maxrss``: everything the process held, torch itself included) over the peak of one
  process training the same model on the same batch (with the ranks' heap setting,
  :mod:`dtrain.modelparallel.heap`), each layout in a fresh world: sharded data parallelism
  of degree 2 (FSDP2; each rank trains on half the batch) with the model created eagerly and
  without memory (made unit by unit as it is sharded); pipelines of 2 and 4 with the model
  created eagerly on every rank (what scripts without
  ``smp.delay_param_initialization`` get), created without memory, and created without memory
  with every block's activations checkpointed (``smp.set_activation_checkpointing``): a
  pipeline holds the activations of the microbatches in flight while it holds gradients too,
  where one process's peak, after its backward, holds none. With ``--breakdown``, also what each
  rank holds after its last step (the base its optimizer step's peak adds AdamW's temporaries
  to): resident memory, its parameters, gradients and optimizer state, the other tensors Python
  reaches (the transport's buffers), MKL's buffers, and glibc's heap in use and free (one
  process and pipelines).
* ``speed``: an 8-block LM of width 512, pp=2, 8 microbatches, ``optimize: speed``: step time
  with the model created without memory over eagerly created, in one world taking turns in
  ABBA order (``--repeats`` pairs, each turn its own ``smp.init``; the median step of each
  turn, then the median of the pairs' ratios). Fresh worlds differ by ±15% in the compute
  itself here, more than the difference measured. The plan differs only in
  where it comes from: the eager model's timed profile, or the delayed model's operation
  counts.
* ``largest``: each process under its own memory cap (a cgroup v1 memory limit, as each GPU
  has its own memory; ``--cap-gib``, the memory the process allocates after it started): the
  most blocks of width 1024 that train 2 AdamW steps in one process against pp=4 with
  delayed initialisation. Needs root and ``/sys/fs/cgroup/memory``.

    python benchmarks/large_models.py --scenario all --json out/large.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _lm import TransformerLM  # benchmarks/ is the script's dir
from _memory import held, layout_lines, lifetime_peak_mib
from _scenarios import run_scenarios

import dtrain.modelparallel as smp
from dtrain.modelparallel import heap
from modelparallel import init_world, leave_world, spawn, tensor_bytes

LM_218M = {"vocab": 8192, "d_model": 1024, "heads": 16, "ff": 4096, "layers": 16, "seq": 128}
LM_SPEED = {"vocab": 8192, "d_model": 512, "heads": 8, "ff": 2048, "layers": 8, "seq": 128}
CGROUP = Path("/sys/fs/cgroup/memory")


def lm_batches(shape: dict[str, int], count: int, batch: int) -> list[tuple[Any, Any]]:
    generator = torch.Generator().manual_seed(1234)
    data = []
    for _ in range(count):
        tokens = torch.randint(0, shape["vocab"], (batch, shape["seq"] + 1), generator=generator)
        data.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return data


def build(shape: dict[str, int], delayed: bool) -> TransformerLM:
    with smp.delay_param_initialization(enabled=delayed):
        return TransformerLM(**shape, seed=0)


def train(args: argparse.Namespace, world: int, rank: int) -> dict[str, Any]:
    """``args.steps`` steps of the variant; this rank's step times and memory."""
    shape = {**LM_SPEED} if args.variant_shape == "speed" else {**LM_218M}
    shape["layers"] = args.layers or shape["layers"]
    data = lm_batches(shape, args.steps, args.batch)
    if world == 1 and not args.pipeline:
        model = TransformerLM(**shape, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(index: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            model(*data[index]).backward()
            optimizer.step()

        params = list(model.parameters())
    else:
        if args.sharded:  # each rank trains on its rows of the global batch
            rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
            data = [(tokens[rows], targets[rows]) for tokens, targets in data]
            config = {"ddp": True, "sharded_data_parallel_degree": world}
        else:
            config = {
                "pipeline_parallel_degree": world,
                "microbatches": args.microbatches,
                "pipeline": "interleaved",
                "auto_partition": True,
                "optimize": args.optimize,
            }
            if args.active_microbatches:
                config["active_microbatches"] = args.active_microbatches
        smp.init(config)
        module = build(shape, args.delayed)
        if args.checkpointed:
            for block in module.blocks:
                smp.set_activation_checkpointing(block)
        dist_model = smp.DistributedModel(module)
        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(dist_model.parameters(), lr=1e-4))

        @smp.step
        def train_step(model: smp.DistributedModel, tokens: Any, targets: Any) -> Any:
            loss = model(tokens, targets)
            model.backward(loss)
            return loss

        def step(index: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            train_step(dist_model, *data[index])
            optimizer.step()

        params = []
    times, cpu_times = [], []
    for index in range(args.steps):
        dist.barrier()
        began, began_cpu = time.perf_counter(), time.process_time()
        step(index)
        cpu_times.append(time.process_time() - began_cpu)
        elapsed = torch.tensor([time.perf_counter() - began])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    if not params:  # sharded: this rank's shards
        params = [getattr(p, "_local_tensor", p) for p in dist_model.local_parameters()]
    breakdown = {}
    if args.breakdown and not args.sharded:  # a sharded rank's state is in DTensors
        state = [t for p in params for t in (p, p.grad) if t is not None]
        moments = [v for s in optimizer.state.values() for v in s.values()]
        breakdown = held(state + [v for v in moments if isinstance(v, torch.Tensor)])
    return {
        "rank": rank,
        "step_seconds": times,
        "step_cpu_seconds": cpu_times,  # this rank's, all its threads
        "parameter_bytes": tensor_bytes(params),
        "peak_rss_mib": lifetime_peak_mib(),
        "held_after_mib": breakdown,
    }


def worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """Train ``args``'s variant in a fresh world; rank 0 puts every rank's row."""
    in_world(rank, port, args, results, lambda: train(args, args.world, rank))


def turns_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """Train eagerly and delayed created models in ``args.turns``' order, in one world (each
    turn its own ``smp.init``): what varies from world to world on this machine (±15% in the
    compute itself) is then the same for both."""

    def turns() -> list[dict[str, Any]]:
        rows = []
        for delayed in args.turns:
            turn = argparse.Namespace(**{**vars(args), "delayed": delayed})
            rows.append({"delayed": delayed, **train(turn, args.world, rank)})
            smp.shutdown()
        return rows

    in_world(rank, port, args, results, turns)


def in_world(
    rank: int, port: int, args: argparse.Namespace, results: Any, work: Callable[[], Any]
) -> None:
    if args.cap_bytes:
        join_capped_cgroup(rank, args.cap_bytes)
    heap.prepare(keep_freed_blocks=False)  # as smp.init does for memory: one process alike
    init_world(rank, args.world, port, args.pin_cores)
    row = work()
    rows: list[Any] = [None] * args.world
    dist.all_gather_object(rows, row)
    leave_world(results, rows if rank == 0 else None)


def variant(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    values = {"layers": 0, "cap_bytes": 0, "pipeline": False, "delayed": False}
    values.update({"checkpointed": False, "sharded": False, "turns": (), **changes})
    return argparse.Namespace(**{**vars(args), **values})


# --- scenario: memory --------------------------------------------------------------------------

MEMORY_LAYOUTS = (
    ("one process", 1, False, False, False),
    ("sdp=2 eager", 2, False, False, False),
    ("sdp=2 delayed", 2, False, True, False),
    ("pp=2 eager", 2, True, False, False),
    ("pp=2 delayed", 2, True, True, False),
    ("pp=2 delayed+ckpt", 2, True, True, True),
    ("pp=4 eager", 4, True, False, False),
    ("pp=4 delayed", 4, True, True, False),
    ("pp=4 delayed+ckpt", 4, True, True, True),
)


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for label, world, pipeline, delayed, checkpointed in MEMORY_LAYOUTS:
        if label not in args.layouts and label != "one process":
            continue
        chosen = variant(
            args,
            world=world,
            pipeline=pipeline,
            sharded=label.startswith("sdp"),
            delayed=delayed,
            checkpointed=checkpointed,
            variant_shape="218m",
            steps=2,
            optimize="memory",
        )
        rows[label] = spawn(worker, world, chosen)
    single = rows["one process"][0]["peak_rss_mib"]
    return {
        "single_peak_rss_mib": single,
        "layouts": {
            label: {
                "peak_rss_mib": [r["peak_rss_mib"] for r in ranks],
                "largest_over_single": max(r["peak_rss_mib"] for r in ranks) / single,
                "parameter_mib": [r["parameter_bytes"] / 2**20 for r in ranks],
                "held_after_mib": [r["held_after_mib"] for r in ranks],
            }
            for label, ranks in rows.items()
        },
    }


def memory_table(r: dict[str, Any]) -> str:
    lines = [f"peak RSS per rank, MiB (one process: {r['single_peak_rss_mib']:.0f})"]
    return "\n".join(lines + layout_lines(r["layouts"], 18))


# --- scenario: speed ---------------------------------------------------------------------------


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    """``args.repeats`` pairs of turns in one world, in ABBA order; each turn's median step
    (rank 0's, which waits for the slowest), and each pair's delayed over eager."""
    turns = [delayed for pair in range(args.repeats) for delayed in (pair % 2 == 1, pair % 2 == 0)]
    chosen = variant(
        args,
        world=2,
        pipeline=True,
        variant_shape="speed",
        steps=args.warmup + args.steps,
        optimize="speed",
        turns=turns,
    )
    rows = spawn(turns_worker, 2, chosen)
    steps = [statistics.median(turn["step_seconds"][args.warmup :]) for turn in rows[0]]
    labels = ["delayed" if turn["delayed"] else "eager" for turn in rows[0]]
    medians = {
        k: [t for t, label in zip(steps, labels, strict=True) if label == k]
        for k in ("eager", "delayed")
    }  # the i-th of each is pair i's
    ratios = [d / e for e, d in zip(medians["eager"], medians["delayed"], strict=True)]
    return {"turns": labels, "turn_medians_s": steps,
            "eager_s": statistics.median(medians["eager"]),
            "delayed_s": statistics.median(medians["delayed"]),
            "pair_ratios": ratios, "delayed_over_eager": statistics.median(ratios)}  # fmt: skip


def speed_table(r: dict[str, Any]) -> str:
    return (
        f"pp=2 step: eager {r['eager_s'] * 1e3:.0f} ms, delayed {r['delayed_s'] * 1e3:.0f} ms,"
        f" delayed/eager {r['delayed_over_eager']:.3f} (median of the pairs'"
        f" {', '.join(f'{x:.3f}' for x in r['pair_ratios'])})"
    )


# --- scenario: largest -------------------------------------------------------------------------


def join_capped_cgroup(rank: int, cap: int) -> None:
    """This process into its own memory cgroup limited to ``cap`` bytes (an OOM kills it)."""
    group = CGROUP / f"dtrain-bench-{os.getppid()}-{rank}"
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(cap))
    (group / "cgroup.procs").write_text(str(os.getpid()))


def remove_cgroup(group: Path) -> None:
    """Remove ``group`` once the killed processes in it are gone."""
    deadline = time.monotonic() + 30
    while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.2)
    group.rmdir()


def trains(args: argparse.Namespace, world: int, layers: int) -> bool:
    chosen = variant(
        args,
        world=world,
        pipeline=world > 1,
        delayed=world > 1,
        variant_shape="218m",
        steps=2,
        layers=layers,
        optimize="memory",
        cap_bytes=int(args.cap_gib * 2**30),
    )
    try:
        spawn(worker, world, chosen)
    except RuntimeError as exc:
        print(f"  {world} rank(s), {layers} blocks: {exc}", file=sys.stderr)
        return False
    finally:
        for group in CGROUP.glob(f"dtrain-bench-{os.getpid()}-*"):
            remove_cgroup(group)
    print(f"  {world} rank(s), {layers} blocks: trained", file=sys.stderr)
    return True


def largest(args: argparse.Namespace, world: int, start: int) -> int:
    """The most blocks that train: doubling from ``start``, then bisecting."""
    good, bad = 0, start
    while trains(args, world, bad):
        good, bad = bad, bad * 2
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if trains(args, world, middle) else (good, middle)
    return good


def run_largest(args: argparse.Namespace) -> dict[str, Any]:
    if not CGROUP.is_dir() or os.geteuid() != 0:
        raise SystemExit("largest needs root and the cgroup v1 memory controller")
    block = 12 * LM_218M["d_model"] ** 2 + 13 * LM_218M["d_model"]  # attention + MLP + norms
    one, four = largest(args, 1, 2), largest(args, 4, 8)
    return {
        "cap_gib": args.cap_gib,
        "one_process_blocks": one,
        "pp4_delayed_blocks": four,
        "block_parameters": block,
        "ratio": four / one if one else float("inf"),
    }


def largest_table(r: dict[str, Any]) -> str:
    millions = r["block_parameters"] / 1e6
    return (
        f"each process capped at {r['cap_gib']:g} GiB: one process trains "
        f"{r['one_process_blocks']} blocks (~{r['one_process_blocks'] * millions:.0f}M), "
        f"pp=4 delayed {r['pp4_delayed_blocks']} (~{r['pp4_delayed_blocks'] * millions:.0f}M):"
        f" {r['ratio']:.1f}x"
    )


TABLES = {"memory": memory_table, "speed": speed_table, "largest": largest_table}
RUNNERS = {"memory": run_memory, "speed": run_speed, "largest": run_largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=(*TABLES, "all"), default="all")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument(
        "--active-microbatches",
        type=int,
        default=0,
        help="pipelines: microbatches in flight (default: SMP's, pipeline degree + 2)",
    )
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (speed)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap-gib", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--layouts",
        type=lambda text: text.split(","),
        default=[layout[0] for layout in MEMORY_LAYOUTS],
        help="memory: comma-separated labels of the layouts to run besides one process",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="memory: what each rank holds after its steps"
    )
    parser.add_argument("--pin-cores", action="store_true", help="rank r on CPU r")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    run_scenarios(args, RUNNERS, TABLES)


if __name__ == "__main__":
    main()

"""What activation checkpointing saves per pipeline rank.

The benchmarks' transformer LM (``_lm.py``: 4 blocks, width 256, sequence 128), split in two
(embeddings + 2 blocks | 2 blocks + head), global batch 16 in ``--microbatches`` microbatches,
AdamW, gloo. Each variant runs in a fresh 2-process world: without checkpointing, and with every
block marked by ``smp.set_activation_checkpointing`` (so blocks 0 and 1 are recomputed on rank
0, blocks 2 and 3 on rank 1, their owner). Per rank: the resident memory after a first step
(which partitions the model and allocates what every step reuses: optimizer state, message
buffers, threads), the peak over the next 2 steps (Linux's high-water mark, reset after the
first step) and the growth between them, which holds gradients and the activations kept for
backward (the variants differ only in the latter). Large tensors are allocated with ``mmap``
and returned on ``free``, so resident memory follows them.

    python benchmarks/activation_checkpointing.py --json out/ckpt.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _lm import TransformerLM  # benchmarks/ is the script's dir
from _memory import peak_mib, reset_peak, resident_mib

import dtrain.modelparallel as smp
from modelparallel import (
    STAGES,
    batches,
    dtrain_pipeline,
    equal_split,
    init_world,
    smp_config,
    spawn,
)

VARIANTS = ("off", "blocks checkpointed")


def worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    init_world(rank, STAGES, port)
    smp.init(smp_config(args.microbatches, auto=False))
    model = TransformerLM(seed=0)
    equal_split(model)
    if args.variant != "off":
        for block in model.blocks:
            smp.set_activation_checkpointing(block)
    data = batches(3, 1024)
    step, _, _ = dtrain_pipeline(model, args.microbatches)
    step(0, data)
    before = resident_mib()
    reset_peak()
    for index in range(1, len(data)):
        step(index, data)
    peak = peak_mib()
    rows: list[Any] = [None] * STAGES
    dist.all_gather_object(rows, {"rank": rank, "before_mib": before, "peak_mib": peak})
    if rank == 0:
        results.put(rows)
    smp.shutdown()
    dist.destroy_process_group()


def table(report: dict[str, Any]) -> str:
    lines = ["resident MiB per rank: after the first step, peak over the next two, growth"]
    for variant in VARIANTS:
        for row in report[variant]:
            growth = row["peak_mib"] - row["before_mib"]
            lines.append(
                f"  {variant:20} pp rank {row['rank']}  {row['before_mib']:7.1f} "
                f"{row['peak_mib']:7.1f} {growth:7.1f}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"microbatches": args.microbatches}
    for variant in VARIANTS:
        report[variant] = spawn(worker, STAGES, argparse.Namespace(**vars(args), variant=variant))
    print(table(report), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

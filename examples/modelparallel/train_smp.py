"""A training script written for SageMaker model parallelism (SMP v1), unmodified.

Run it as a job with 2 pipeline partitions on 2 processes, 4 microbatches::

    dtrain run train_smp.py --source-dir examples/modelparallel --processes-per-host 2 \\
        --distribution '{"smdistributed": {"modelparallel": {"enabled": true, "parameters":
            {"partitions": 2, "microbatches": 4, "pipeline": "interleaved"}}},
            "mpi": {"enabled": true, "processes_per_host": 2}}' \\
        --hyperparameters '{"steps": 20}'

The model is a GPT-2 style LM in plain PyTorch (``gpt.py``); the data are random token sequences,
so the loss falls as the model learns their unigram statistics.
"""

from __future__ import annotations

import argparse
import os

import smdistributed.modelparallel.torch as smp
import torch
from gpt import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args, _ = parser.parse_known_args()  # SageMaker also passes --mp_parameters

    smp.init()
    torch.manual_seed(args.seed)
    model = smp.DistributedModel(build_model(dropout=0.0, layers=4))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @smp.step
    def train_step(model: smp.DistributedModel, input_ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids, labels=input_ids)
        model.backward(loss)
        return loss

    # Each data-parallel replica draws its own batches; a skewed unigram distribution to learn.
    generator = torch.Generator().manual_seed(args.seed + smp.dp_rank())
    weights = torch.arange(1, 513, dtype=torch.float).pow(-1.2)
    for step in range(args.steps):
        input_ids = torch.multinomial(
            weights, args.batch_size * 64, replacement=True, generator=generator
        ).view(args.batch_size, 64)
        optimizer.zero_grad()
        loss = train_step(model, input_ids).reduce_mean()
        optimizer.step()
        if smp.rank() == 0:
            print(f"step={step} train_loss={loss.item():.4f}", flush=True)

    if smp.rank() == 0:
        print(model.partition_plan().table(), flush=True)
    if smp.dp_rank() == 0:
        state = model.state_dict()  # every pipeline rank takes part in gathering it
        if smp.rank() == 0:
            torch.save(state, os.path.join(os.environ.get("SM_MODEL_DIR", "."), "model.pt"))


if __name__ == "__main__":
    main()

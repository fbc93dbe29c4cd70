"""Data-parallel training that checkpoints every step and resumes from the last checkpoint; on
the first attempt, rank ``KILLED_RANK`` is killed (SIGKILL) before step 2, so only a retry can
finish it."""

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests.dataparallel.scenarios import LR, ROOT_SEED, STEPS, batch, mlp, params_of

from dtrain.dataparallel import DistributedDataParallel

dist.init_process_group("gloo")
rank = dist.get_rank()
checkpoint = Path(os.environ["DTRAIN_CHECKPOINT_DIR"], "state.pt")
module = mlp(ROOT_SEED)
first = 0
if checkpoint.exists():
    state = torch.load(checkpoint, weights_only=True)
    module.load_state_dict(state["model"])
    first = state["step"] + 1
    print(f"resumed after step {state['step']}", flush=True)
model = DistributedDataParallel(module)
optimizer = torch.optim.SGD(model.parameters(), lr=LR)
for step in range(first, STEPS):
    if step == 2 and os.environ["DTRAIN_ATTEMPT"] == "1" and rank == int(os.environ["KILLED_RANK"]):
        os.kill(os.getpid(), signal.SIGKILL)
    optimizer.zero_grad()
    x, y = batch(step, rank)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    dist.barrier()
    if rank == 0:
        partial = checkpoint.with_suffix(".partial")
        torch.save({"step": step, "model": module.state_dict()}, partial)
        partial.replace(checkpoint)
    dist.barrier()
if rank == 0:
    torch.save(params_of(module), Path(os.environ["SM_MODEL_DIR"], "params.pt"))
dist.destroy_process_group()

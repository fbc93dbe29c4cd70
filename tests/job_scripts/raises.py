"""Rank 1 raises after the group is up; the others block in a collective that never completes."""

import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(0.5)
    raise ValueError("boom from rank 1")
print("waiting in barrier", flush=True)
dist.barrier()
time.sleep(600)
os._exit(0)

"""One rank (``FAILING_RANK``, default 1) raises after the group is up; the others block in a
collective that never completes."""

import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == int(os.environ.get("FAILING_RANK", "1")):
    time.sleep(0.5)
    print(f"raising at {time.time()!r}", flush=True)
    raise ValueError(f"boom from rank {rank}")
print("waiting in barrier", flush=True)
dist.barrier()
time.sleep(600)
os._exit(0)

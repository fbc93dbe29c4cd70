"""Steps for minutes: an all-reduce every 0.1 s, printing each, until the job is stopped."""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
print("started", flush=True)
value = torch.ones(4)
for step in range(6000):
    dist.all_reduce(value)
    value.fill_(1.0)
    print(f"step {step}", flush=True)
    time.sleep(0.1)

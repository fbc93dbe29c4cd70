"""Data-parallel training through SageMaker's SMDDP API, as the tests' single-process reference
trains it (``tests.dataparallel.scenarios``, on ``PYTHONPATH``); rank 0 saves the parameters and
every rank reports its environment. The ``smddp`` backend is used without importing
``torch_smddp``: importing any ``smdistributed.dataparallel`` module provides it."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from smdistributed.dataparallel.torch.parallel.distributed import (  # noqa: F401 - as AWS's
    DistributedDataParallel,  # examples import it; "smddp" is then registered, no torch_smddp
)
from tests.dataparallel.scenarios import plain

dist.init_process_group("smddp")
rank, world = dist.get_rank(), dist.get_world_size()
result = plain(rank, world)
report = {
    "env": {k: v for k, v in os.environ.items() if k.startswith(("SM_", "GLOO_", "MASTER_"))},
    "hierarchical": result["hierarchical"],
}
Path(os.environ["SM_OUTPUT_DATA_DIR"], f"report-rank{rank}.json").write_text(json.dumps(report))
if rank == 0:
    torch.save(result["params"], Path(os.environ["SM_MODEL_DIR"], "params.pt"))
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()

"""Each rank writes its own TensorBoard events, as a SageMaker script does under
/opt/ml/output/tensorboard; rank 0 also prints a loss for the job's metric definitions."""

import os

from torch.utils.tensorboard import SummaryWriter

rank = int(os.environ["RANK"])
folder = os.environ.get("DTRAIN_TENSORBOARD_DIR", "/opt/ml/output/tensorboard")
with SummaryWriter(os.path.join(folder, f"rank{rank}")) as writer:
    for step in range(4):
        writer.add_scalar("rank/value", 10 * rank + step, global_step=step)
        if rank == 0:
            print(f"loss={1.0 / (step + 1):.4f}", flush=True)

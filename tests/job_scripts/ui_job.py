"""A falling loss on every rank and, from rank 0, a pipeline timeline (Chrome trace JSON) in
output/data: what the web view's browser test looks for. Imports no torch, to start fast."""

import json
import os

rank = int(os.environ["RANK"])
for step in range(8):
    print(f"step={step} train_loss={1.0 / (step + 1):.4f}", flush=True)
if rank == 0:
    events = [
        {"name": f"{kind}{mb}", "cat": kind, "ph": "X", "pid": 0, "tid": stage}
        | {"ts": 1000.0 * (2 * mb + stage + (kind == "B") * 6), "dur": 900.0}
        for kind in ("F", "B")
        for mb in range(2)
        for stage in range(2)
    ]
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"rank {s}"}}
        for s in range(2)
    ]
    with open(os.path.join(os.environ["SM_OUTPUT_DATA_DIR"], "timeline.json"), "w") as out:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, out)

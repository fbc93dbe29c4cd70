"""Prints a falling loss until the file named by WAIT_FOR exists (the test makes it once the
console has shown that loss), so the job trains exactly as long as the test needs."""

import os
import time
from pathlib import Path

marker = Path(os.environ["WAIT_FOR"])
deadline = time.monotonic() + 60
step = 0
while not marker.exists() and time.monotonic() < deadline:
    step += 1
    print(f"loss={1.0 / step:.4f}", flush=True)
    time.sleep(0.05)

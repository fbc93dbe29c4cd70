"""Runs until stopped, printing a heartbeat, to test --max-run, dtrain stop and Ctrl-C."""

import os
import time
from pathlib import Path

if os.environ["RANK"] == "0":
    Path(os.environ["SM_MODEL_DIR"], "partial.txt").write_text("saved before stop")
print("started", flush=True)
for beat in range(6000):
    print(f"beat {beat}", flush=True)
    time.sleep(0.1)

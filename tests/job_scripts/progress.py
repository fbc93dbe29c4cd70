"""Rank 0 draws a progress bar as tqdm does (carriage returns on stderr) and finishes it once the
file named by PROGRESS_GATE exists; rank 1 writes nothing at all."""

import os
import sys
import time

if int(os.environ["RANK"]) == 0:
    for tenth in range(6):
        sys.stderr.write(f"\r{tenth * 10:3d}%|{'#' * tenth:10}|")
        sys.stderr.flush()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["PROGRESS_GATE"]):
        if time.monotonic() > deadline:
            sys.exit("the gate never opened")
        time.sleep(0.02)
    sys.stderr.write(f"\r100%|{'#' * 10}|\n")
    print("done", flush=True)

"""Waits for minutes on the first attempt (for its host to be lost); ends at once on a retry."""

import os
import time

attempt, host = os.environ["DTRAIN_ATTEMPT"], os.environ["SM_CURRENT_HOST"]
if attempt == "1":
    print("waiting", flush=True)
    time.sleep(600)
print(f"attempt {attempt} on {host}", flush=True)

"""Rank 1 is SIGKILLed.

Every rank first starts a grandchild in its own session that must not survive.
"""

import os
import signal
import subprocess
import sys
import time

subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
subprocess.Popen(["sleep", "600"])
print("started helpers", flush=True)
if os.environ["RANK"] == "1":
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(600)

"""Say, for each variable named in ``SCANNED`` (comma-separated), a digest of its value and
which processes of the machine hold that value in their arguments.

While a rank runs, its whole job is alive (``dtrain run`` or the detached controller, the
agents, the ranks), so a value that any of them got on a command line is found.
"""

import hashlib
import os
from pathlib import Path


def holders(value: bytes) -> list[str]:
    found = []
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        try:
            argv = (process / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if value in argv:
            found.append(" ".join(part.decode(errors="replace") for part in argv.split(b"\0")[:4]))
    return found


for name in os.environ["SCANNED"].split(","):
    value = os.environ[name].encode()
    print(f"{name} sha256={hashlib.sha256(value).hexdigest()} in argv of: {holders(value)}")

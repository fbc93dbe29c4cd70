"""The host's last line of defence: when its agent dies, whatever the ranks started dies too.

The agent starts one keeper in a session of its own and holds the write end of its standard
input. When that closes (the agent exited, or was killed with SIGKILL), the keeper kills every
process that carries the agent's marker in its environment, until none is left. Ranks themselves
also die with the agent (parent-death signal); the keeper catches what they started, which
otherwise would be adopted by init and run on.

    python -m dtrain.launch.keeper DTRAIN_AGENT=<token>
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

from dtrain.launch.processes import marked_processes, signal_pids

SWEEPS = 50
"""Rounds of killing: a process may fork while its siblings are being killed."""
CLEAN_SCANS = 2
"""Empty scans in a row that end the sweep: a process in the middle of ``exec`` shows no
environment in /proc (so no marker) for a moment after its parent already saw it started."""


def sweep(
    marker: bytes,
    scan: Callable[[bytes], list[int]] = marked_processes,
    kill: Callable[[list[int]], None] = lambda pids: signal_pids(pids, signal.SIGKILL),
    pause: Callable[[float], None] = time.sleep,
) -> None:
    clean = 0
    for _ in range(SWEEPS):
        found = scan(marker)
        clean = 0 if found else clean + 1
        if clean == CLEAN_SCANS:
            return
        if found:
            kill(found)
        pause(0.02)


def main(argv: list[str]) -> int:
    marker = argv[0].encode()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only its agent's end can end it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    sweep(marker)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A host's ranks: output line by line, exits with their last traceback, and nothing left over
when they are stopped, when their agent is killed, or when a rank's children outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from dtrain.launch.processes import descendants, marked_processes
from dtrain.launch.ranks import LocalRanks, RankLaunch

MARKER = "DTRAIN_AGENT=test-ranks"


def launch(rank: int, code: str, tmp_path: Path) -> RankLaunch:
    env = {**os.environ, MARKER.split("=")[0]: f"{MARKER.split('=')[1]}-{os.getpid()}"}
    return RankLaunch(rank, [sys.executable, "-c", textwrap.dedent(code)], env, tmp_path)


def wait_for_exits(ranks: LocalRanks, count: int) -> list:
    exits: list = []
    deadline = time.monotonic() + 30
    while len(exits) < count and time.monotonic() < deadline:
        exits += ranks.poll()
        time.sleep(0.02)
    return exits


def test_output_and_exits_with_the_traceback_of_the_failing_rank(tmp_path: Path) -> None:
    lines: list[tuple[int, str]] = []
    ranks = LocalRanks(
        [
            launch(0, "print('hello'); print('bye')", tmp_path),
            launch(1, "print('about to fail', flush=True)\nraise ValueError('boom')", tmp_path),
        ],
        lambda rank, line: lines.append((rank, line)),
    )
    started = time.time()
    ranks.start()
    exits = {e.rank: e for e in wait_for_exits(ranks, 2)}
    assert [line for rank, line in lines if rank == 0] == ["hello", "bye"]
    assert exits[0].code == 0 and exits[0].tail == ""
    assert exits[1].code == 1 and not exits[1].stopped
    assert exits[1].tail.startswith("Traceback (most recent call last):")
    assert exits[1].tail.splitlines()[-1] == "ValueError: boom"
    assert started <= exits[1].time <= time.time()
    assert not ranks.running


def test_an_exit_waits_for_every_line_however_slow_the_reader(tmp_path: Path) -> None:
    """The exit of a rank comes after all its output even when the thread reading it is held
    up (a loaded machine): the report once waited only for a 0.5 s pause in the output."""
    lines: list[str] = []

    def slow_consumer(rank: int, line: str) -> None:
        if line == "19000":  # the rank has written all it writes by now, and exits meanwhile
            time.sleep(1.0)
        lines.append(line)

    code = "for i in range(20000): print(i)\nprint('last', end='')"
    ranks = LocalRanks([launch(0, code, tmp_path)], slow_consumer)
    ranks.start()
    (exit_,) = wait_for_exits(ranks, 1)
    assert exit_.code == 0 and lines == [*map(str, range(20000)), "last"]


def test_stop_ends_ranks_and_what_they_started_in_other_sessions(tmp_path: Path) -> None:
    code = """
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
        print("started", flush=True)
        time.sleep(600)
    """
    seen: list[str] = []
    ours = descendants(os.getpid())  # the test's own (a fork server): an agent spares its keeper
    ranks = LocalRanks(
        [launch(0, code, tmp_path)], lambda rank, line: seen.append(line), grace=1, spare=ours
    )
    ranks.start()
    deadline = time.monotonic() + 30
    while "started" not in seen and time.monotonic() < deadline:
        time.sleep(0.02)
    marker = f"{MARKER}-{os.getpid()}".encode()
    assert len(await_marked(marker, 2)) == 2
    ranks.stop()
    (ended,) = ranks.poll()
    assert ended.stopped and ended.code == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_processes(marker) == []


def await_marked(marker: bytes, count: int) -> list[int]:
    """The processes carrying ``marker``, once ``count`` show (or 5 s passed). A child that
    printed after starting its own child may be seen first: ``Popen`` returns once that child's
    exec is past the point of no return, a moment before /proc shows its environment."""
    deadline = time.monotonic() + 5
    while len(found := marked_processes(marker)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


AGENT = """
import os, sys, time
from pathlib import Path
from dtrain.launch.ranks import LocalRanks, RankLaunch
env = {**os.environ, "DTRAIN_AGENT": sys.argv[1]}
code = (
    "import subprocess, sys, time; subprocess.Popen(['sleep', '600'], start_new_session=True);"
    "print('up', flush=True); time.sleep(600)"
)
rank = RankLaunch(0, [sys.executable, "-c", code], env, Path("."))
ranks = LocalRanks([rank], lambda rank, line: print(line, flush=True))
ranks.start()
time.sleep(600)
"""


def test_a_killed_agent_takes_its_ranks_and_the_keeper_their_children(tmp_path: Path) -> None:
    token = f"killed-agent-{os.getpid()}"
    marker = f"DTRAIN_AGENT={token}".encode()
    keeper = subprocess.Popen(
        [sys.executable, "-m", "dtrain.launch.keeper", marker.decode()],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, token], stdout=subprocess.PIPE, text=True
    )
    assert agent.stdout is not None and agent.stdout.readline().strip() == "up"
    assert len(await_marked(marker, 2)) == 2  # the rank and its detached child
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + 5
    while len(marked_processes(marker)) > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(marked_processes(marker)) == 1  # the rank died with its agent; its child did not
    assert keeper.stdin is not None
    keeper.stdin.close()  # as when the agent holding it dies
    assert keeper.wait(timeout=10) == 0
    assert marked_processes(marker) == []

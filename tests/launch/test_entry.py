"""The rank runner: a script behaves as under ``python`` (compared run by run), and a rank that
leaves collectives pending at exit still ends as its script did."""

from __future__ import annotations

import gzip
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import JOB_SCRIPTS

RUNNER = [sys.executable, "-m", "dtrain.launch.entry"]
ADDRESS = re.compile(r"0x[0-9a-f]+")

PROBE = """
import sys
print(repr(sys.argv), repr(sys.path[0]), __name__, __file__, __spec__, __package__, __cached__)
print(type(__loader__).__name__, sys.modules["__main__"] is sys.modules[__name__])
print(sorted(globals()))
"""

SCRIPTS = {
    "probe": PROBE,
    "exit code": "import sys\nprint('out')\nsys.exit(3)\n",
    "exit message": "import sys\nsys.exit('goodbye')\n",
    "exit none": "raise SystemExit(None)\n",
    "exit wraps": "raise SystemExit(256 + 7)\n",
    "exception": (
        "def inner():\n    raise ValueError('boom')\n"
        "try:\n    inner()\nexcept ValueError as e:\n    raise RuntimeError('outer') from e\n"
    ),
    "syntax error": "print('never'\n",
    "interrupt": "print('before', flush=True)\nraise KeyboardInterrupt\n",
    "signal": "import os, signal\nprint('x', flush=True)\nos.kill(os.getpid(), signal.SIGTERM)\n",
    "threads and atexit": (
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit ran')\n"
        "atexit.register(lambda: 1 / 0)\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
        "print('main done')\n"
    ),
    "unflushed output": "import sys\nprint('buffered')\nsys.stderr.write('err')\n",
    "pickles its own class": (
        "import pickle\nclass Point:\n    pass\n"
        "print(type(pickle.loads(pickle.dumps(Point()))).__qualname__)\n"
    ),
}


def both(cwd: Path, *args: str) -> list[tuple[int, str, str]]:
    """(code, stdout, stderr) of ``python args`` and of the runner with the same ``args``;
    object addresses, which differ from run to run, are masked."""
    results = []
    for command in ([sys.executable], RUNNER):
        done = subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True)
        masked = [ADDRESS.sub("0x?", text) for text in (done.stdout, done.stderr)]
        results.append((done.returncode, *masked))
    return results


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_script_behaves_as_under_python(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "script.py").write_text(SCRIPTS[name])
    plain, ran = both(tmp_path, "code/script.py", "--lr", "0.1")
    assert ran == plain


def test_a_linked_script_and_a_module_behave_as_under_python(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "script.py").write_text(PROBE)
    (tmp_path / "link.py").symlink_to(tmp_path / "real" / "script.py")
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "__init__.py").write_text("")
    (tmp_path / "package" / "main.py").write_text(PROBE + "raise SystemExit(4)\n")
    for args in (["link.py"], ["-m", "package.main", "a"], ["-m", "package.absent"]):
        plain, ran = both(tmp_path, *args)
        assert ran == plain, args
    plain, ran = both(tmp_path, "missing.py")
    assert ran == plain and plain[0] == 2


def test_files_left_open_are_complete_and_standard_streams_stay_usable(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(
        "import atexit, gzip, sys\n"
        "packed = gzip.open('packed.gz', 'wt')\npacked.write('all of it')\n"
        "plain = open('plain.txt', 'w')\nplain.write('text')\n"
        "atexit.register(print, 'stdout still open')\n"
    )
    done = subprocess.run([*RUNNER, "script.py"], cwd=tmp_path, capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "stdout still open\n", "")
    assert gzip.decompress((tmp_path / "packed.gz").read_bytes()) == b"all of it"
    assert (tmp_path / "plain.txt").read_text() == "text"


def test_an_interrupted_script_dies_of_sigint(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPTS["interrupt"])
    plain, ran = both(tmp_path, "script.py")
    assert ran[0] == plain[0] == -signal.SIGINT


def test_smddp_exists_before_a_data_parallel_jobs_script_runs(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(
        "import torch.distributed as dist\nprint('smddp' in dist.Backend.backend_list)\n"
    )
    env = {
        **os.environ,
        "SM_FRAMEWORK_PARAMS": '{"sagemaker_distributed_dataparallel_enabled":true}',
    }
    done = subprocess.run([*RUNNER, "script.py"], cwd=tmp_path, capture_output=True, text=True,
                          env=env)  # fmt: skip
    assert done.stdout == "True\n", done.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_ranks_leaving_collectives_pending_at_exit_end_as_their_script_did() -> None:
    """Plain ``python`` aborts at least one rank of most such pairs here (SIGABRT, 'terminate
    called without an active exception'): three pairs in a row must all end cleanly."""
    for _ in range(3):
        env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())}  # fmt: skip
        ranks = [
            subprocess.Popen(
                [*RUNNER, str(JOB_SCRIPTS / "pending_at_exit.py")],
                env={**env, "RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(2)
        ]
        for rank, process in enumerate(ranks):
            output = process.communicate(timeout=120)[0]
            assert process.returncode == 0, output
            assert f"rank {rank} finished\nrank {rank} atexit ran\n" in output
            assert "terminate called" not in output


def test_the_job_key_leaves_the_environment_before_the_script_runs(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(
        "import os\nfrom dtrain.jobkey import take_key\n"
        "print(os.environ.get('DTRAIN_JOB_KEY'), take_key().hex())\n"
    )
    env = {**os.environ, "DTRAIN_JOB_KEY": "ab" * 32}
    done = subprocess.run([*RUNNER, "script.py"], cwd=tmp_path, capture_output=True, text=True,
                          env=env)  # fmt: skip
    assert done.stdout == f"None {'ab' * 32}\n", done.stderr

"""One fork server for every multi-process test: ranks start as forks of a clean process that
imported torch, dtrain and the test models once, instead of each importing them again (that
import dominated multi-process tests on 2 cores).

A forked rank inherits the server's environment, not the test's: callers pass the test's
``os.environ`` along and the rank takes it (:func:`take_environment`), as a spawned one would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Mapping
from multiprocessing import forkserver

PRELOADED = (
    "torch", "torch.distributed", "dtrain.dataparallel", "dtrain.modelparallel",
    "tests.modelparallel.equivalence", "tests.modelparallel.hf_cases",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert",
    "transformers.models.llama.modeling_llama",
)  # fmt: skip


def rank_context() -> mp.context.ForkServerContext:
    """The context to start ranks in: forks of the one server, which has no threads and none
    of the test's state."""
    _forget_a_dead_server()
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


def _forget_a_dead_server() -> None:
    """A test that stops the launcher's ranks in the pytest process ends every descendant of
    the process (the launcher's rule), the server included, and reaps it; multiprocessing would
    then fail to start another (it waits for a pid that is gone), so forget the dead one."""
    server = forkserver._forkserver  # the one server multiprocessing keeps per process
    pid = server._forkserver_pid
    if pid is None:
        return
    try:
        ended = os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # reaped by the launcher's own sweep
        ended = True
    if ended:
        os.close(server._forkserver_alive_fd)
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None


def take_environment(environment: Mapping[str, str]) -> None:
    """In a rank: the environment it would have inherited, had it been spawned by the test."""
    os.environ.clear()
    os.environ.update(environment)

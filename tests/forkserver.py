"""One fork server for every multi-process test: ranks start as forks of a clean process that
imported torch, dtrain and the test models once, instead of each importing them again (that
import dominated multi-process tests on 2 cores).

A forked rank inherits the server's environment and standard streams, not the test's: callers
pass an :class:`Inheritance` along and the rank takes it, so it runs with the test's environment
and writes where the test's output goes now (``capfd`` sees it), as a spawned rank would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import reduction
from typing import Any

PRELOADED = (
    "torch", "torch.distributed", "dtrain.dataparallel", "dtrain.modelparallel",
    "tests.modelparallel.equivalence", "tests.modelparallel.hf_cases",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert",
    "transformers.models.llama.modeling_llama",
)  # fmt: skip


def rank_context() -> mp.context.ForkServerContext:
    """The context to start ranks in: forks of the one server, which has no threads and none
    of the test's state."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


class Inheritance:
    """What a spawned rank would inherit from the test: its environment, and its standard
    output and error as they are when the rank starts (passed as descriptors)."""

    def __init__(
        self, environment: dict[str, str] | None = None, streams: tuple[Any, ...] = ()
    ) -> None:
        self.environment = dict(os.environ) if environment is None else environment
        self.streams = streams

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled while the rank starts: the descriptors travel with it to the fork.
        return Inheritance, (self.environment, (reduction.DupFd(1), reduction.DupFd(2)))

    def take(self) -> None:
        """In the rank: the test's environment, and its output to where the test's goes."""
        os.environ.clear()
        os.environ.update(self.environment)
        for target, stream in zip((1, 2), self.streams, strict=True):
            os.dup2(stream.detach(), target)

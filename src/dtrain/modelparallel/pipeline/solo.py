"""Waiting for work one rank does alone, for as long as it takes, not for a fixed time.

At the first step rank 0 profiles the whole model and plans the partition while every other
rank waits for the plan. A large model traced on the CPU takes longer than any wait for a peer
should (``DTRAIN_MP_TIMEOUT``), and nothing bounds it in advance. So the worker beats in the
job's rendezvous store while it works, and says when it is done; the others wait for that and
fail only once the beats have stopped for ``timeout`` seconds: the worker is gone, or so stuck
that even its beating thread does not run. (A worker whose own code loops for ever keeps
beating: that is a hang of the script, which the job's ``max_run`` ends.)

The beats are a counter, compared with its previous value on the waiter's own clock, so hosts
need not agree on the time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from dtrain.modelparallel.errors import CommunicationTimeoutError, ModelParallelError
from dtrain.modelparallel.pipeline.stall import Store

BEAT_S = 5.0
"""Longest pause between two beats (shorter for a short ``timeout``)."""

LONGEST_POLL_S = 1.0
"""Longest pause between two looks at the store while waiting (the first ones are shorter,
so quick work is not waited for much longer than it takes)."""


@contextlib.contextmanager
def working(store: Store | None, name: str, timeout: float) -> Iterator[None]:
    """On the worker: beat under ``name`` while the block runs, then say it is done (also when
    it raises). Without a store, nothing (the others do not wait either)."""
    if store is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(min(BEAT_S, timeout / 4)):
            with contextlib.suppress(Exception):  # a missed beat is only a missed beat
                store.add(f"{name}/beats", 1)

    thread = threading.Thread(target=beat, name=f"dtrain-{name}-beats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        store.set(f"{name}/done", "1")


def wait_for(store: Store | None, name: str, timeout: float, rank: int, what: str) -> None:
    """On the others: return once the worker's block under ``name`` has ended; raise once its
    beats have stopped for ``timeout`` seconds. ``what`` says whose work it is, for errors."""
    if store is None:
        return
    beats, since, pause = -1, time.monotonic(), 0.01
    try:
        while not store.check([f"{name}/done"]):
            seen = store.add(f"{name}/beats", 0)
            now = time.monotonic()
            if seen != beats:
                beats, since = seen, now
            elif now - since > timeout:
                raise CommunicationTimeoutError(
                    f"rank {rank}: waiting for {what}: no sign of life for {timeout:g} s"
                )
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_POLL_S)
    except RuntimeError as exc:  # the store is gone (it often lives in rank 0's process)
        raise ModelParallelError(f"rank {rank}: waiting for {what}: {exc}") from exc

"""The main task's token lent to served requests while a rank other than the leader is in a step.

The thread that runs the user's script holds its rank's compute token outside steps, so a request
that arrives early (the leader already started the next step) waits until this rank has finished
its own work (e.g. ``optimizer.step()``) and entered the step. During the step the main thread
only waits for the leader's end: it lends the token to the requests it serves meanwhile, and
takes it back, in message order, when the step's end arrives.
"""

from __future__ import annotations

from dtrain.modelparallel.pipeline.compute_token import ComputeToken
from dtrain.modelparallel.scheduling.scheduler import Scheduler


class MainLending:
    """The main task's side of a step it does not lead."""

    def __init__(self, token: ComputeToken) -> None:
        self.token = token
        self._reclaimed = False
        """The step's end arrived before the main thread lent the token: it keeps it."""

    def lend(self) -> None:
        """The main thread waits for the step to end: served tasks may compute meanwhile."""

        def lent(core: Scheduler) -> None:
            if not self._reclaimed:
                self.token.release(self.token.main)

        self.token.decide(lent)

    def reclaim(self) -> None:
        """The step ended (called by the receiver, in message order): the main task gets the
        token before any request that arrives later, which belongs to the next step and must
        wait until this rank has finished its own work (e.g. the optimizer step)."""
        main = self.token.main

        def reclaimed(core: Scheduler) -> None:
            self._reclaimed = True
            if core.holder is not main and not core.is_waiting(main):
                self.token.enqueue(main)

        self.token.decide(reclaimed)

    def resume(self) -> None:
        """Back on the main thread after :meth:`reclaim`: hold the token again."""
        if not self.token.main.holding:
            self.token.await_token(self.token.main)

        def resumed(core: Scheduler) -> None:
            self._reclaimed = False

        self.token.decide(resumed)

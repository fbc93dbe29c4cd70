"""The leader's step: one task per microbatch, admitted as the scheduling core allows, and the
policy's hold before a microbatch's backward.

The leader (pp rank 0) runs the step body once per microbatch, each in a task of its own. The
main thread admits them (while fewer than ``active_microbatches`` are in flight) and waits for
them to finish; each task computes with the rank's :class:`~.compute_token.ComputeToken`, which
holds every decision (admission, the hold, the terminal rule) in its core.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dtrain.modelparallel.modules.tasks import MicrobatchResult
from dtrain.modelparallel.pipeline.compute_token import ComputeToken, Task
from dtrain.modelparallel.scheduling.scheduler import Scheduler


class LeaderStep:
    """The leader's microbatch tasks on its compute token."""

    def __init__(
        self,
        token: ComputeToken,
        spawn: Callable[[Callable[[], None]], None],
    ) -> None:
        """``spawn`` runs a task on a thread of its own."""
        self.token = token
        self.spawn = spawn
        self._microbatches = 0
        """The step in progress admits this many in all."""

    def run_microbatches(
        self, count: int, body: Callable[[int], Any], step_number: int = 0
    ) -> list[MicrobatchResult]:
        """Run ``body(mb)`` for every microbatch as leader tasks; the main task waits meanwhile."""
        token = self.token
        outcomes: list[MicrobatchResult] = [(False, None)] * count
        self._microbatches = count
        token.decide(Scheduler.begin_step)
        token.release(token.main)
        try:
            for mb in range(count):
                token.wait_until(Scheduler.may_admit, f"a free slot for microbatch {mb}")
                task = Task("leader", token.ask(Scheduler.admit), step=step_number)
                token.enqueue(task)  # here, not on its thread: the token goes in microbatch order
                self.spawn(functools.partial(self._leader_task, task, body, outcomes))
            token.wait_until(
                lambda core: core.finished_count == count, "the microbatch tasks to finish"
            )
        finally:
            token.acquire(token.main)
            token.decide(Scheduler.end_step)
        return outcomes

    def _leader_task(
        self,
        task: Task,
        body: Callable[[int], Any],
        outcomes: list[MicrobatchResult],
    ) -> None:
        """A microbatch's step body. Its task was queued for the token when it was admitted,
        so microbatches start in order: whichever thread the pool started first took the token
        before, and a later microbatch often computed its first modules ahead of microbatch 0
        (measured: the last stage's first input came up to 16 ms late)."""
        mb = task.microbatch
        token = self.token
        try:
            with token.running(task):
                token.await_token(task)
                token.hold_between(task, computed=False)  # as after a computation
                outcomes[mb] = (True, body(mb))
        except BaseException as exc:
            outcomes[mb] = (False, exc)
        finally:

            def finished(core: Scheduler) -> bool:
                if task.holding:
                    token.release(task, grant=False)
                core.finished(task)
                return not self._admits_next(core)

            token.decide(finished)

    def _admits_next(self, core: Scheduler) -> bool:
        """The main thread is about to admit a microbatch: it queues for the token before the
        token goes on, as the plan has it (a forward, which feeds the other stages, before a
        terminal backward)."""
        return core.leading and core.admitted < self._microbatches and core.may_admit()

    def start_backward(self) -> Task | None:
        """A microbatch task turns to its backward: the policy's hold.

        ``simple`` holds the task, without the token, until every microbatch has finished its
        forward. ``interleaved`` lets a task keep a token it holds from its forward, so the
        backward request goes out before the next microbatch computes. Returns the task
        (``None`` outside a microbatch task).
        """
        token = self.token
        task = token.current()
        if task is None or task.role != "leader" or not token.ask(lambda core: core.leading):
            return None
        if task.holding and not token.sticky(task):  # called inside a computation
            token.release(task)
        if task.phase == "F":
            token.notices.forward_over(task)
            task.phase = "B"
            if not token.ask(Scheduler.backward_may_start):
                if task.holding:
                    token.release(task)
                token.flush(task)
                token.wait_until(
                    Scheduler.backward_may_start,
                    f"every forward before backward {task.microbatch} ({token.policy.pipeline})",
                )
        return task

    @contextmanager
    def backward(self) -> Iterator[None]:
        """A microbatch task's backward: :meth:`start_backward`, then compute with the token
        (queued with backward priority). The task keeps the token after it, between
        computations: when the task ends, the leader admits the next microbatch before the
        token moves on (:meth:`_leader_task`), as the plan has it."""
        task = self.start_backward()
        if task is None:
            yield
            return
        self.token.take(task, "")
        try:
            yield
        finally:
            if task.holding:
                self.token.hold_between(task)

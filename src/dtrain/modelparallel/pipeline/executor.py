"""One rank's executor: its compute token, the threads its tasks run on, the leader's step and
the main task's lending, put together.

Each part is a concept of its own with a narrow interface: :mod:`.compute_token` (the
scheduling core behind the rank's one lock, the tasks' hand-over of the token, the timeline of
what they computed), :mod:`.leader` (the leader's microbatch tasks: admission and the hold
before a backward), :mod:`.lending` (the main thread's token lent to served requests during a
step it does not lead). The leader's step and the lending change the core only through the
token's :meth:`~.compute_token.ComputeToken.decide` and read it through ``ask``; this class
adds the pooled threads tasks run on.

A split backward's weight half is a task of its own (:meth:`Executor.run_weights`), ranked
after all other work, so it runs when the rank would otherwise wait. The step ends on a rank
only once every weight half it deferred has run: while the main task waits for the token, only
weight halves may take it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from dtrain.modelparallel.pipeline.compute_token import ComputeToken, Task
from dtrain.modelparallel.pipeline.leader import LeaderStep, MicrobatchResult
from dtrain.modelparallel.pipeline.lending import MainLending
from dtrain.modelparallel.pipeline.notices import ALONE, Messenger
from dtrain.modelparallel.pipeline.workers import WorkerPool
from dtrain.modelparallel.scheduling.ordering import Ordering
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.timeline import TimelineEvent

__all__ = ["Executor", "MicrobatchResult", "Task"]


class Executor(ComputeToken):
    """The compute token of one rank, the threads of its tasks, its leader's step and the
    main task's lending."""

    def __init__(
        self,
        pp_rank: int,
        policy: SchedulePolicy,
        timeout: float,
        ordering: Ordering,
        flush: Callable[[Task], None] = lambda task: None,
        device: torch.device | None = None,
        messenger: Messenger = ALONE,
    ) -> None:
        """See :class:`.ComputeToken` for ``ordering``, ``flush`` and ``messenger``;
        ``device`` is the one task threads start on."""
        super().__init__(pp_rank, policy, timeout, ordering, flush, messenger)
        self._workers = WorkerPool(f"dtrain-mp-{pp_rank}", device)
        self.leader = LeaderStep(self, self._workers.submit)
        self.lending = MainLending(self)

    def spawn(self, target: Callable[[], None]) -> None:
        """Run a served task on a pooled thread."""
        self._workers.submit(target)

    def run_weights(
        self, task: Task, run: Callable[[], None], failed: Callable[[BaseException], None]
    ) -> None:
        """Run the owed weight half ``task`` (``run``) when nothing more urgent waits; what
        fails it, its turn included, goes to ``failed`` (the step fails: on its own thread it
        would only be printed, and the gradients would silently lack it)."""
        self.spawn(functools.partial(self._weights_task, task, run, failed))

    def _weights_task(
        self, task: Task, run: Callable[[], None], failed: Callable[[BaseException], None]
    ) -> None:
        try:
            with self.serving(task), self.computing(task.name):
                run()
        except BaseException as exc:
            failed(exc)
        finally:
            self.notices.weights_paid(task)

    # --- the leader's step and the main task's lending (see their modules) ----------------------

    def run_microbatches(
        self, count: int, body: Callable[[int], Any], step_number: int = 0
    ) -> list[MicrobatchResult]:
        return self.leader.run_microbatches(count, body, step_number)

    def start_backward(self) -> Task | None:
        return self.leader.start_backward()

    def backward(self) -> AbstractContextManager[None]:
        return self.leader.backward()

    def lend_main(self) -> None:
        self.lending.lend()

    def reclaim_main(self) -> None:
        self.lending.reclaim()

    def resume_main(self) -> None:
        self.lending.resume()

    # --- timeline ----------------------------------------------------------------------------

    def timeline(self, communication: bool = False) -> list[TimelineEvent]:
        """The work this rank computed since the last :meth:`clear_timeline` (with
        ``communication``, also its sends, receives and waits)."""
        return self.recorder.events(communication)

    def clear_timeline(self) -> None:
        self.recorder.clear()

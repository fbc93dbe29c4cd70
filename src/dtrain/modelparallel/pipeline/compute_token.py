"""Who computes next on a rank: one compute token, handed out by the scheduling core.

A pipeline stage is one worker, so a rank computes one task at a time. Tasks are threads: on the
leader one per microbatch (the step body), on every rank one per stream of requests served
(see :mod:`.runtime`). A task takes the token to compute (:meth:`ComputeToken.computing`: a
module this rank owns, a served request, a backward) and gives it back while it waits for a
remote reply, so another task (another microbatch, or a nested request) can use the stage
meanwhile.

Between two computations a task keeps the token (*sticky*) unless a more urgent task is
waiting: the next module of the same microbatch follows at once. Handing the token to whichever
task waits at every module boundary interleaved two microbatches module by module, which
delayed both on their way to the next partition and left it idle. Before a task waits, or
computes, the requests it queued are sent (``flush``), so nothing queued waits on it.

Every decision (which waiting task gets the token, whether a holder keeps it, whether the leader
admits another microbatch and whether a backward may begin) is the rank's
:class:`~..scheduling.scheduler.Scheduler`'s, the thread-free core the planner runs too. This
module is the only place that holds its lock: it wakes the tasks the core grants the token to,
and others change or read the core through :meth:`ComputeToken.decide`,
:meth:`ComputeToken.ask` and :meth:`ComputeToken.wait_until`, never under a lock of their own.

The process's random generators are shared by every thread: a task that forked them for a block
(:mod:`..modules.generators`) owns the fork (:attr:`Task.owned`), which the token sets aside when
the task gives it up and puts back when the task has it again, so that the others draw from the
process's generators meanwhile, not the block's.

The thread that runs the user's script is the *main* task: it holds the token outside steps
(:mod:`.lending` lends it to served requests during one).

Whose turn it is follows the rank's ordering (:mod:`..scheduling.ordering`): every task, or
with a plan order (``deterministic_server``) only those of the rank's current action. What the
token and the rest of the runtime see happen that may end an action (a task waits, computes
again, its microbatch's forward moves on) goes to :mod:`.notices`, the one place that tells the
core and the other ranks.

Every period a task computes is recorded as a :class:`TimelineEvent` (rank = pp rank), in the
rank's :class:`TimelineRecorder`, where the transport records its sends and receives too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dtrain.modelparallel.errors import CommunicationTimeoutError
from dtrain.modelparallel.modules.tasks import Owned, running_as, running_task
from dtrain.modelparallel.pipeline.notices import ALONE, Messenger, Notices
from dtrain.modelparallel.scheduling.ordering import Ordering
from dtrain.modelparallel.scheduling.policy import SchedulePolicy
from dtrain.modelparallel.scheduling.scheduler import Scheduler, Work
from dtrain.modelparallel.timeline import TimelineRecorder

T = TypeVar("T")


@dataclass(eq=False)
class Task(Work):
    """Work of this rank with the thread that runs it: its wake-up and what it sends."""

    holding: bool = False
    """The task's thread has woken up with the token (the scheduler's holder since then)."""
    recording: bool = True
    """The current holding period is computation (a timeline event), not the time between."""
    started: float = 0.0
    granted: threading.Event = field(default_factory=threading.Event, repr=False)
    """Set when the token is handed to this task: only the new holder wakes up."""
    calls: list[Any] = field(default_factory=list, repr=False)
    """Remote calls this task made that are not known to have succeeded yet."""
    outbox: list[Any] = field(default_factory=list, repr=False)
    """Requests this task queued instead of sending (see :class:`ComputeToken`)."""
    owned: list[Owned] = field(default_factory=list, repr=False)
    """What the task holds only with the token, innermost last: set aside before another task
    may take the token, put back once this one has it again."""


class ComputeToken:
    """The compute token of one rank: its scheduling core behind one lock, the tasks' hand-over
    and the timeline of what they computed."""

    def __init__(
        self,
        pp_rank: int,
        policy: SchedulePolicy,
        timeout: float,
        ordering: Ordering,
        flush: Callable[[Task], None] = lambda task: None,
        messenger: Messenger = ALONE,
    ) -> None:
        """``ordering`` says whose turn it is; ``flush`` sends what a task queued in its
        ``outbox``: called before the task blocks (for the token or a condition) and before it
        computes a module, so that nothing queued waits on the task's own progress;
        ``messenger`` takes notices to the other ranks. The main task holds the token from
        here on."""
        self.pp_rank = pp_rank
        self.flush = flush
        self.policy = policy
        self.timeout = timeout
        self.main = Task("main")
        self.core = Scheduler(policy, ordering, self.main)
        """Every decision; read and changed only with ``_cv`` held."""
        self.notices = Notices(self, ordering, messenger)
        """Where the runtime reports what may end an action."""
        self._cv = threading.Condition()
        self.recorder = TimelineRecorder(pp_rank)
        self._progress = time.monotonic()
        self.acquire(self.main)

    # --- the core, under the lock ---------------------------------------------------------------

    def decide(self, change: Callable[[Scheduler], bool | None]) -> None:
        """Change the core: ``change`` returns whether the token may go on (it is then handed
        to whom the core grants it). Either way work moved, and whoever waits in
        :meth:`wait_until` looks again."""
        with self._cv:
            if change(self.core):
                self._grant()
            self._progress = time.monotonic()
            self._cv.notify_all()

    def ask(self, question: Callable[[Scheduler], T]) -> T:
        """Read the core."""
        with self._cv:
            return question(self.core)

    def wait_until(self, predicate: Callable[[Scheduler], bool], what: str) -> None:
        """Wait for ``predicate`` of the core (changed by :meth:`decide`); time out only after
        ``timeout`` seconds without progress."""
        with self._cv:
            while not predicate(self.core):
                remaining = self._progress + self.timeout - time.monotonic()
                if remaining <= 0:
                    raise CommunicationTimeoutError(
                        f"pp rank {self.pp_rank}: no progress for {self.timeout:g} s while "
                        f"waiting for {what}"
                    )
                self._cv.wait(remaining)

    def _grant(self) -> None:
        """Wake the task the core hands a free token to (call with the lock held)."""
        task = self.core.grant()
        if task is not None:
            assert isinstance(task, Task)
            task.granted.set()

    # --- the token ---------------------------------------------------------------------------

    def enqueue(self, task: Task) -> None:
        """Ask for the token on behalf of ``task`` without waiting (e.g. from the receiver)."""
        with self._cv:
            task.granted.clear()
            self.core.submit(task)
            self._grant()

    def announce(self, task: Task) -> None:
        """``task`` (a stream of requests just dispatched, about to start on its thread) will
        ask for the token: no task dispatched after it takes the token before it, unless more
        urgent. Requests are dispatched in arrival order, but their threads start in any
        order; a later microbatch's forward computed first changes what it leaves behind
        (BatchNorm's running statistics, the order of random numbers)."""
        with self._cv:
            self.core.announce(task)

    def acquire(self, task: Task) -> None:
        self.enqueue(task)
        self.await_token(task)

    def await_token(self, task: Task) -> None:
        """Wait until an enqueued ``task`` holds the token."""
        if not task.granted.is_set():
            self.flush(task)
        if not task.granted.wait(self.timeout):
            with self._cv:
                if self.core.holder is not task:
                    self.core.drop(task)
                    holder = self.core.holder
                    held_by = holder.describe() if holder else "nobody"
                    raise CommunicationTimeoutError(
                        f"pp rank {self.pp_rank}: {task.describe()} waited {self.timeout:g} s "
                        f"for the compute token, held by {held_by}"
                    )
        with self._cv:
            task.holding = True
            task.recording = True
            task.started = self._now()
            self._progress = time.monotonic()
            for owned in task.owned:
                owned.resume()

    def release(self, task: Task, grant: bool = True) -> None:
        """``task`` gives the token back; it goes on at once unless not ``grant``."""
        with self._cv:
            for owned in reversed(task.owned):
                owned.leave()
            self.core.release(task)
            self._record(task)
            task.holding = False
            self._progress = time.monotonic()
            if grant:
                self._grant()

    def _record(self, task: Task) -> None:
        """The holder's computation up to now, as a timeline event."""
        if task.role != "main" and task.recording:
            name = task.name or f"{task.phase}{task.microbatch}"
            self.recorder.add(task.phase, task.microbatch, task.started, name, visit=task.visit)

    def _yield_if_urgent(self, task: Task) -> None:
        """A task holding the token between computations gives it to a more urgent waiter
        (or gives it up: its turn has passed)."""
        with self._cv:
            if self.core.outranked(task):
                self.release(task)

    def sticky(self, task: Task) -> bool:
        """Whether ``task`` holds the token between two computations."""
        with self._cv:
            return task.holding and self.core.holder is task and self.core.sticky

    def activity(self) -> str:
        """What holds the token now, and for how long (for stall reports)."""
        with self._cv:
            holder = self.core.holder
            waiting = self.core.waiting
            turn = self.core.ordering.describe_turn()
            turn = f"; in the plan's order it is the turn of {turn}" if turn else ""
            if not isinstance(holder, Task):
                return f"nothing computes (the compute token is free, {waiting} wait){turn}"
            held = self._now() - holder.started
        what = holder.describe()
        if holder.role != "main":
            what += f" computing {holder.name!r}" if holder.recording else " between computations"
        held_for = f"has held the compute token for {held:.0f} s ({waiting} tasks wait for it)"
        return f"{what} {held_for}{turn}"

    @property
    def last_progress(self) -> float:
        """Monotonic time of the last token hand-over: work is still moving on this rank."""
        return self._progress

    def _now(self) -> float:
        """Wall-clock seconds from a monotonic clock, comparable across processes."""
        return self.recorder.now()

    # --- tasks -------------------------------------------------------------------------------

    def current(self) -> Task | None:
        """The task running on this thread, or the token holder (autograd's device threads).

        The main task never counts: code running there is outside any step.
        """
        task = running_task()
        if isinstance(task, Task):
            return task
        holder = self.core.holder
        return holder if isinstance(holder, Task) and holder.role != "main" else None

    @contextmanager
    def running(self, task: Task) -> Iterator[Task]:
        """This thread runs as ``task`` (:meth:`current`) meanwhile."""
        with running_as(task):
            yield task

    @contextmanager
    def serving(self, task: Task) -> Iterator[Task]:
        """Run served requests as ``task`` on this thread; it gives the token back at the end,
        and, announced, stops holding others up."""
        with self.running(task):
            try:
                yield task
            finally:
                if task.holding:
                    self.release(task)
                self.decide(lambda core: core.withdraw(task))

    @contextmanager
    def computing(self, name: str) -> Iterator[None]:
        """Compute ``name`` (a module, or a served request) as the current task, with the token.

        The task keeps the token afterwards (*sticky*) unless a more urgent task waits: its
        next computation (the next module of the same forward, the next request of the same
        stream) follows at once instead of queueing behind a less urgent microbatch, which
        would only delay this one on its way through the pipeline. Code that already computes
        (a module inside a module) runs as it is.
        """
        task = self.current()
        if self._computes_already(task):
            yield
            return
        assert task is not None
        self.take(task, name)
        try:
            yield
        finally:
            if task.holding:
                self.hold_between(task)
                self._yield_if_urgent(task)

    def computes_already(self) -> bool:
        """Whether a computation on this thread runs as it is (:meth:`computing` would do
        nothing): outside any task, or inside a computation of its task (a module inside a
        module, which need not pay for a context manager)."""
        return self._computes_already(self.current())

    def _computes_already(self, task: Task | None) -> bool:
        return task is None or (task.holding and not self.sticky(task))

    def hold_between(self, task: Task, computed: bool = True) -> None:
        """The holder keeps the token for its next computation: its computation ended
        (recorded), or, not ``computed``, it has just woken up with the token."""
        with self._cv:
            if computed:
                self._record(task)
            task.recording = False
            self.core.between(task)

    def take(self, task: Task, name: str) -> None:
        """Hold the token to compute ``name``: kept from the task's last computation unless a
        more urgent task waits, else queued for; what the task queued is sent first."""
        if task.away:  # its waits for calls' replies ended its visit after all
            with self.waiting(coming_back=True):
                pass
        self.notices.placing(task, name)
        if task.outbox:
            self.flush(task)
        if task.holding:
            self._yield_if_urgent(task)
        task.name = name
        if task.holding:
            with self._cv:
                task.started = self._now()
                task.recording = True
                self.core.resume(task)
        else:
            self.acquire(task)  # a token just granted is not sticky
        self.core.computes(task)  # the holder's own flag: no lock needed

    def give_way(self) -> None:
        """The current task, computing, lets a more urgent waiting task compute first, then
        goes on (a weight half between its autograd calls, a terminal backward at its
        weights)."""
        task = self.current()
        if task is None or not task.holding:
            return
        with self._cv:
            if not self.core.outranked(task):
                return
            self.release(task)  # records the work so far
        self.acquire(task)

    def step_aside(self) -> None:
        """The current task, holding the token between computations, is about to do other work
        (send a reply): any waiting task may compute meanwhile."""
        task = self.current()
        if task is not None and task.holding:
            with self._cv:
                if self.core.steps_aside(task):
                    self.release(task)

    @contextmanager
    def waiting(self, reply: bool = False, coming_back: bool = False) -> Iterator[None]:
        """Give the token away while the current task waits for another rank (or for another
        task's result; for a remote call's ``reply``, awaited only to learn its outputs'
        structure, see :meth:`~..scheduling.ordering.PlannedOrdering.visit_over`); a sticky
        holder does not take it back afterwards. ``coming_back``: no wait, but the visit its
        waits for replies left ends here)."""
        task = self.current()
        if task is not None and coming_back:
            self.notices.comes_back(task)
        elif task is not None:
            self.notices.waits(task, reply)
        if task is None or not task.holding:
            yield
            return
        sticky = self.sticky(task)
        self.release(task)
        try:
            yield
        finally:
            if not sticky:
                self.notices.placing(task, task.name)
                self.acquire(task)

    # --- weight halves -------------------------------------------------------------------------

    def owe_weights(self, task: Task) -> None:
        """The weight half ``task`` (of a split backward, not spawned yet) is due: the main
        task waits for it. Owed before the backward replies, so that no end of the microbatch
        can be taken for the end of its weights."""
        with self._cv:
            self.core.owe(task.step, task.microbatch)

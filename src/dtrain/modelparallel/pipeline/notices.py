"""What the runtime tells its scheduling core, in one place: that work of a rank is over.

The caller, the owner, the leader's step, the token and the dispatcher each report an event
here (the leader's forward moved on or turned to its backward, a microbatch's last backward
ran, a weight half was paid, a task waits or computes again, another rank's notice arrived);
what the event ends, and who must learn it, is the rank's ordering's to say
(:mod:`..scheduling.ordering`). This module carries it out: a change of the core under the
token's lock, or a ``NOTICE`` message to the other ranks. The free ordering learns nothing, so
under it an event is a call that does nothing: no lock, no message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.scheduling.ordering import NOTICES, Notice, Ordering
from dtrain.modelparallel.scheduling.route import ORDER_ADVICE
from dtrain.modelparallel.scheduling.scheduler import Scheduler, Work
from dtrain.modelparallel.transport.message import NOTICE, Message

T = TypeVar("T")


class Token(Protocol):
    """The rank's compute token, whose lock guards the core (:mod:`.compute_token`)."""

    def decide(self, change: Callable[[Scheduler], bool | None]) -> None: ...

    def ask(self, question: Callable[[Scheduler], T]) -> T: ...


class Messenger(Protocol):
    """How notices reach the other ranks (the runtime's transport)."""

    def to_peers(self, work: Work, message: Message) -> None:
        """Send ``message`` to every other rank, after the requests ``work`` queued."""

    def queue_for(self, work: Work, partition: int, message: Message) -> None:
        """Queue ``message`` for ``partition`` after the requests ``work`` queued for it."""


class Alone:
    """The messenger of a rank with no other rank to tell."""

    def to_peers(self, work: Work, message: Message) -> None:
        pass

    def queue_for(self, work: Work, partition: int, message: Message) -> None:
        pass


ALONE = Alone()
"""Stateless: one for every rank alone."""


class Notices:
    """The runtime's events, told to this rank's core and to the others as its ordering says
    (the :class:`~..scheduling.ordering.Tell` the ordering tells through)."""

    def __init__(self, token: Token, ordering: Ordering, messenger: Messenger) -> None:
        self._token = token
        self._ordering = ordering
        self._messenger = messenger

    # --- the events ----------------------------------------------------------------------------

    def moved_on(self, task: Work, partition: int) -> None:
        """The leader's ``task`` calls a module on partition ``partition``."""
        self._ordering.moved_on(self, task, partition)

    def forward_over(self, task: Work) -> None:
        """The leader's ``task`` turns to its backward: its forward is done (``simple``'s hold
        counts it) and over here, then on the other ranks, after the requests it queued."""
        missed = self._ordering.visit_missed(self, task)
        if missed is not None:
            raise ModelParallelError(
                f"deterministic_server: {missed}: the plan follows the model's modules in "
                "the order they are registered; register them in the order the forward "
                "calls them, or set deterministic_server to false"
            )
        self._token.decide(lambda core: core.forward_over(task))
        self._ordering.forward_over(self, task)

    def microbatch_over(self, task: Work) -> None:
        """The leader's ``task`` ran its microbatch's step body (its calls are settled)."""
        self._ordering.microbatch_over(self, task)

    def backward_over(self, step: int, microbatch: int) -> None:
        """The microbatch's last backward request here has run (before its reply: the next
        action computes meanwhile)."""
        self._ordering.backward_over(self, step, microbatch)

    def weights_paid(self, task: Work) -> None:
        """The owed weight half ``task`` has run (or failed): its action is over, and the main
        task may be next."""

        def paid(core: Scheduler) -> bool:
            core.paid(task.step, task.microbatch)
            return True

        self._token.decide(paid)

    def waits(self, task: Work, reply: bool = False) -> None:
        """``task`` gives the token away to wait for another rank (for a call's ``reply``,
        awaited only to learn its outputs' structure)."""
        self._ordering.waits(self, task, reply)

    def comes_back(self, task: Work) -> None:
        """``task`` waited for replies since it computed last and computes here again."""
        self._ordering.comes_back(self, task)

    def placing(self, task: Work, name: str) -> None:
        """``task`` is about to ask for the token to compute ``name``: the ordering places it,
        and work it cannot order fails, naming the module."""
        where = self._ordering.placing(self, task)
        if where is None:
            return
        raise ModelParallelError(
            f"deterministic_server: module {name!r} would compute {where}: the plan's order "
            "(deterministic_server, or tensor_parallel_degree above 1) needs every microbatch "
            "to go through the partitions in order (0, 1, ...), then back to partition 0 or "
            "not, and was made for the modules in the order they are registered, which the "
            "forward does not follow here (a module registered before another but called "
            "after it, or one whose code runs again after a submodule elsewhere). "
            f"{ORDER_ADVICE}"
        )

    def heard(self, message: Message) -> None:
        """Another rank's ``NOTICE`` arrived (after the requests sent before it were
        dispatched)."""
        notice = message.body
        if notice not in NOTICES:
            raise ModelParallelError(f"unknown notice {notice!r} from rank {message.source}")
        self._ordering.heard(self, notice, message.step, message.microbatch)

    # --- how the ordering tells -------------------------------------------------------------------

    def here(self, change: Callable[[Scheduler], bool]) -> None:
        self._token.decide(change)

    def ask(self, question: Callable[[Scheduler], T]) -> T:
        return self._token.ask(question)

    def peers(self, work: Work, notice: Notice) -> None:
        self._messenger.to_peers(work, _message(work, notice))

    def after_queued(self, work: Work, partition: int, notice: Notice) -> None:
        self._messenger.queue_for(work, partition, _message(work, notice))


def _message(work: Work, notice: Notice) -> Message:
    return Message(NOTICE, 0, body=notice, microbatch=work.microbatch, step=work.step)

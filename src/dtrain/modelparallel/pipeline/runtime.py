"""One rank of a pipeline: its caller and owner sides, and the steps that drive them.

The leader (pp rank 0) runs the step body once per microbatch, each in its own task; calls to
modules owned elsewhere become requests to their owners (:mod:`.caller`, :mod:`.remote`), and
every rank serves the requests it receives (:mod:`.owner`). The executor's compute token
decides which task computes next, as the schedule policy says (:mod:`.executor`,
:mod:`..scheduling.policy`). Here: the messages the receivers queue are dispatched, on one thread in
arrival order (:mod:`.dispatch`: requests to the owner, step ends to the main thread); the
leader's step runs its microbatches and announces their results, which the other ranks of the
pipeline return from the step too; a silence is reported (:mod:`.stall`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import queue
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtrain.modelparallel.errors import (
    CommunicationTimeoutError,
    ModelParallelError,
    RemoteError,
    StepFailedError,
)
from dtrain.modelparallel.heap import release_blas_buffers
from dtrain.modelparallel.modules.activations import plan_checkpointing
from dtrain.modelparallel.modules.backward import scaled_grads
from dtrain.modelparallel.modules.modes import ComputeMode
from dtrain.modelparallel.modules.stubs import install_stub, remove_stub
from dtrain.modelparallel.modules.unfetched import materialize
from dtrain.modelparallel.options import RuntimeOptions
from dtrain.modelparallel.pipeline.caller import RemoteCaller
from dtrain.modelparallel.pipeline.dispatch import Dispatcher, StepGate
from dtrain.modelparallel.pipeline.executor import Executor, MicrobatchResult, Task
from dtrain.modelparallel.pipeline.group import PipelineGroup, RankParts
from dtrain.modelparallel.pipeline.owner import Owner
from dtrain.modelparallel.pipeline.remote import RemoteValue
from dtrain.modelparallel.pipeline.split_backward import backward_giving_way
from dtrain.modelparallel.pipeline.stall import RankState, StallWatch, WaitBoard, default_store
from dtrain.modelparallel.scheduling.ordering import Ordering
from dtrain.modelparallel.scheduling.policy import Phase, SchedulePolicy
from dtrain.modelparallel.scheduling.scheduler import Work
from dtrain.modelparallel.timeline import TimelineEvent
from dtrain.modelparallel.transport.message import (
    BACKWARD,
    END_STEP,
    FETCH,
    FORWARD,
    NOTICE,
    Message,
    error_body,
)
from dtrain.modelparallel.transport.structure import flatten, unflatten
from dtrain.modelparallel.transport.wire import Transport

Stream = list[tuple[Message, list[torch.Tensor]]]
"""Messages one receive brought, in order (see :mod:`..transport.wire`)."""
_POLL_S = 0.5
_EXIT_WAIT_S = 60.0
"""Longest a rank that reaches the end of its script waits for its peers to reach theirs."""

GIL_SWITCH_INTERVAL_S = 0.0005
"""Python hands the GIL to a waiting thread after this long (default 5 ms). A rank's receiver
and its tasks take turns at every message, and each turn costing up to 5 ms would stall the
whole pipeline behind whichever thread runs Python code."""


class PipelineRuntime:
    """Calls, serves and steps for one rank; built once the partition plan is known."""

    def __init__(
        self,
        group: PipelineGroup,
        modules: dict[str, nn.Module],
        owners: dict[str, int],
        policy: SchedulePolicy,
        options: RuntimeOptions,
        ordering: Ordering,
    ) -> None:
        """``ordering``: this rank's (:mod:`..scheduling.ordering`): work runs as it becomes
        ready, or in the plan row's order every step (``deterministic_server``)."""
        checkpointing = plan_checkpointing(modules[""], owners)  # fails before anything starts
        self.group = group
        self._modules = modules
        self.executor = Executor(
            group.pp_rank, policy, group.timeout, ordering, self._flush, group.device, self
        )
        self._inbox: queue.Queue[tuple[Message, list[torch.Tensor]]] = queue.Queue()
        """Step ends and failures, for the main thread."""
        self._gate: StepGate[Stream] = StepGate()
        self._dispatcher: Dispatcher[Stream] | None = None
        self._steps = 0
        self._in_step = False
        self._step_started = float("-inf")
        """Monotonic time this rank entered its current or last step (a stall counts from it)."""
        self.transport: Transport | None = None
        self.waits = WaitBoard()
        """This rank's waits on other ranks, for stall reports."""
        self._stall: StallWatch | None = None
        self._switch_interval = sys.getswitchinterval()
        """The interpreter's, restored at close."""
        if len(group.ranks) > 1:
            sys.setswitchinterval(min(self._switch_interval, GIL_SWITCH_INTERVAL_S))
            assert group.message_group is not None
            self._dispatcher = Dispatcher(
                f"dtrain-mp-dispatch-{group.rank}", self._dispatch, self._dispatch_failed
            )
            self.transport = Transport(
                group.rank,
                group.ranks,
                group.message_group,
                group.device,
                group.timeout,
                self._dispatcher.put,
                recorder=self.executor.recorder,
            )
        parts = RankParts(group, self.transport, self.executor, modules, owners)
        self.caller = RemoteCaller(parts, self.waits)
        self.owner = Owner(parts, policy, self.caller)
        if self.transport is not None:
            atexit.register(self._close_at_exit)
            self._stall = self._watch_stalls(options.stall_report)
        for name, module in modules.items():
            if owners[name] != group.pp_rank:
                install_stub(module, self.caller.stub(name))
            elif name:
                install_stub(module, self.owner.guard(name, checkpointing.forward_of(name, module)))
            elif checkpointing.changes(name):
                install_stub(module, checkpointing.forward_of(name, module))

    @property
    def is_leader(self) -> bool:
        return self.group.pp_rank == 0

    def _flush(self, task: Task) -> None:
        """Send what ``task`` queued (the executor asks before a task blocks or computes)."""
        self.caller.flush(task)

    def _watch_stalls(self, limit: float) -> StallWatch:
        transport = self.transport
        assert transport is not None
        watch = StallWatch(
            rank=self.group.rank,
            ranks=self.group.ranks,
            limit=limit,
            last_progress=lambda: max(
                transport.last_activity, self.executor.last_progress, self._step_started
            ),
            in_step=lambda: self._in_step,
            state=self._rank_state,
            store=default_store(),
            publish=lambda text: print(text, file=sys.stderr, flush=True),
        )
        watch.start()
        return watch

    def _rank_state(self) -> RankState:
        return RankState(self.group.rank, self.executor.activity(), self.waits.snapshot())

    def _explained(self, error: BaseException) -> BaseException:
        """A timeout, with the stall report of the silence that led to it (if one was made)."""
        # A report made during the wait that just timed out (it began at most timeout ago).
        within = self.group.timeout
        report = self._stall.recent_report(within) if self._stall is not None else None
        if isinstance(error, CommunicationTimeoutError) and report:
            explained = CommunicationTimeoutError(f"{error}\n{report}")
            explained.__cause__ = error
            return explained
        return error

    def _dispatch(self, messages: Stream) -> None:
        """The dispatcher thread: the requests of one stream (one caller's, in its order) are
        served one after the other by one task; step ends and failures go to the inbox.

        Serving them in order cannot deadlock: a request can only depend on earlier ones (the
        caller sent it after them, never waiting in between). A request of the leader's next
        step waits for this rank's end of the current one (:class:`~.dispatch.StepGate`).
        """
        first = messages[0][0]
        request = not self.is_leader and first.kind in (FORWARD, FETCH, BACKWARD)
        if request and not self._gate.admit(first.step, messages):
            return
        jobs: list[tuple[Phase, Callable[[], None]]] = []
        heard: list[Message] = []
        for message, tensors in messages:
            for step, microbatch in message.extra.get("released", ()):
                self.owner.forget_microbatch(step, microbatch)
            if message.kind in (FORWARD, FETCH, BACKWARD):
                jobs.append(self.owner.accept(message, tensors))
            elif message.kind == NOTICE:
                heard.append(message)
            elif message.kind == END_STEP and not self.is_leader:
                self.executor.reclaim_main()  # before any request of the next step
                due = self._gate.end(message.call_id)
                self._inbox.put((message, tensors))
                for stream in due:
                    self._dispatch(stream)
            else:
                if not self.is_leader:
                    self.executor.reclaim_main()
                self._inbox.put((message, tensors))
        if jobs:
            task = Task("serve", first.microbatch, jobs[0][0], step=first.step)
            if first.kind != FETCH:  # it will compute: its place in line is kept
                self.executor.announce(task)
            self.executor.spawn(functools.partial(self.owner.serve_stream, task, jobs))
        for notice in heard:  # after the requests before them are announced
            self.executor.notices.heard(notice)

    def to_peers(self, work: Work, message: Message) -> None:
        """Send ``message`` (a notice) to every other rank of the pipeline, after the requests
        ``work`` queued (the executor's :class:`~.notices.Messenger`)."""
        assert isinstance(work, Task)
        self.caller.flush(work)
        if self.transport is None:
            return  # a pipeline of one rank
        with contextlib.suppress(ModelParallelError):  # broken pipeline: the waits say so
            for peer in self.transport.peers:
                self.transport.send(peer, message)

    def queue_for(self, work: Work, partition: int, message: Message) -> None:
        """Queue ``message`` (a notice) for ``partition`` in ``work``'s outbox, after the
        requests it queued for it (the executor's :class:`~.notices.Messenger`)."""
        assert isinstance(work, Task)
        work.outbox.append((self.group.ranks[partition], message, []))

    def _dispatch_failed(self, error: BaseException) -> None:
        """A message could not be dispatched: the pipeline is broken on this rank, as if its
        messaging had failed (every wait for a reply here fails, naming the error)."""
        assert self.transport is not None
        failure = ModelParallelError(
            f"rank {self.group.rank}: dispatching a message failed: {type(error).__name__}: {error}"
        )
        failure.__cause__ = error
        self.transport.fail(failure)

    def run_step(self, count: int, body: Callable[[int], Any] | None) -> list[MicrobatchResult]:
        """Every rank of the pipeline: the leader runs ``body`` per microbatch, others serve.

        Returns each microbatch's outcome on every rank; a failure on the leader comes back as
        ``(False, error)`` on all ranks.
        """
        self._steps += 1
        self.executor.clear_timeline()
        self._step_started = time.monotonic()
        self._in_step = True
        try:
            if self.is_leader:
                assert body is not None
                return self._lead_step(count, body)
            return self._follow_step()
        finally:
            self._in_step = False
            release_blas_buffers()  # every task thread's: not held through the optimizer step

    def _lead_step(self, count: int, body: Callable[[int], Any]) -> list[MicrobatchResult]:
        """The leader's step: its microbatches, then their outcomes to every rank."""
        try:
            mode = ComputeMode.current()  # the step's caller's, for the microbatch threads
            outcomes = self.executor.run_microbatches(
                count, functools.partial(self._run_microbatch, body, mode), self._steps
            )
        except CommunicationTimeoutError as exc:  # the others stop waiting for the end too
            error = self._explained(exc)
            self._announce([(False, error)])
            raise error from exc
        finally:
            self.owner.forget_served(None)
        outcomes = [(ok, value if ok else self._explained(value)) for ok, value in outcomes]
        self._announce(outcomes)
        self.owner.raise_weights_failure()
        return outcomes

    def _follow_step(self) -> list[MicrobatchResult]:
        """Another rank's step: serve until the leader announces the outcomes."""
        try:
            outcomes, ended = self._await_step_end()
        except CommunicationTimeoutError as exc:
            raise self._explained(exc) from exc
        self.owner.forget_served(ended)
        self.owner.raise_weights_failure()
        return outcomes

    def _run_microbatch(
        self, body: Callable[[int], Any], mode: ComputeMode, microbatch: int
    ) -> Any:
        """One microbatch on the leader, under the step caller's modes: its result fetched,
        its calls checked, then released everywhere."""
        task = self.executor.current()
        assert task is not None
        try:
            with mode.applied():
                result = materialize(body(microbatch))
            self.caller.check_calls(task)
            return result
        finally:
            self.caller.drop_calls(task)
            self._release(task.step, microbatch)
            self.executor.notices.microbatch_over(task)

    def _release(self, step: int, microbatch: int) -> None:
        """Nothing of this microbatch is needed any more, here or on the other ranks."""
        self.owner.forget_microbatch(step, microbatch)
        self.caller.release(step, microbatch)

    def abort_step(self, error: BaseException) -> None:
        """The leader could not start the step: release the other ranks with the error."""
        self._steps += 1
        self._announce([(False, error)])

    def _announce(self, outcomes: list[MicrobatchResult]) -> None:
        if self.transport is None:
            return
        payload = [
            (ok, value if ok else error_body(self.group.rank, value)) for ok, value in outcomes
        ]
        structure, tensors = flatten(payload)
        tensors = [t.detach() for t in tensors]
        self.caller.clear_releases()
        for peer in self.transport.peers:
            self.transport.send(peer, Message(END_STEP, self._steps, body=structure), tensors)

    def _await_step_end(self) -> tuple[list[MicrobatchResult], int]:
        """The outcomes the leader announces at the end of its step, and that step's number."""
        assert self.transport is not None
        leader = self.group.ranks[0]
        executor = self.executor
        executor.lend_main()
        try:
            with self.waits.waiting(leader, f"the end of step {self._steps}", blocking=False):
                message, tensors = self._next_from_leader(leader)
        finally:
            executor.reclaim_main()
            executor.resume_main()
        if message.kind != END_STEP:
            raise ModelParallelError(f"rank {self.group.rank}: pipeline failed: {message.body}")
        outcomes: list[MicrobatchResult] = []
        for ok, value in unflatten(message.body, tensors):
            if not ok and isinstance(value, RemoteError) and not isinstance(value, StepFailedError):
                value = StepFailedError(
                    value.rank, value.exc_type, value.message, value.remote_traceback
                )
            outcomes.append((ok, value))
        return outcomes, message.call_id

    def _next_from_leader(self, leader: int) -> tuple[Message, list[torch.Tensor]]:
        """The next message of the inbox; fails after ``timeout`` seconds of silence."""
        assert self.transport is not None
        while True:
            try:
                return self._inbox.get(timeout=_POLL_S)
            except queue.Empty:
                progress = max(self.transport.last_activity, self.executor.last_progress)
                if time.monotonic() - progress > self.group.timeout:
                    raise CommunicationTimeoutError(
                        f"rank {self.group.rank}: nothing from the pipeline for "
                        f"{self.group.timeout:g} s while waiting for the leader (rank "
                        f"{leader}) to end step {self._steps}"
                    ) from None

    def in_step(self) -> bool:
        """Whether the calling thread is one of this rank's tasks of a step."""
        return self.executor.current() is not None

    def backward(self, outputs: list[Any], grads: list[Any], scale: float | None) -> None:
        """``model.backward`` inside a step. A loss another partition computed and nobody
        fetched goes to its owner with its gradient in one request; other outputs run their
        backward here, giving the token away while they wait for remote gradients."""
        grads = materialize(grads)  # computed elsewhere: fetch
        if len(outputs) == 1 and isinstance(outputs[0], RemoteValue) and not outputs[0].fetched:
            self.executor.start_backward()  # the request goes out without the token
            self.caller.backward_deferred(outputs[0], grads[0], scale)
            return
        outputs = materialize(outputs)
        grads = scaled_grads(outputs, grads, scale)
        with self.executor.backward():
            backward_giving_way(outputs, grads, self.executor.give_way)

    def timeline(self, communication: bool) -> list[TimelineEvent]:
        """What this rank computed in the last step; with ``communication``, its sends,
        receives and waits too."""
        return self.executor.timeline(communication)

    def _close_at_exit(self) -> None:
        """A script that ends without ``smp.shutdown()``: stop together with the peers.

        Otherwise a receiver still waiting on its peer gets the peer's exit as an error while
        the interpreter finalizes, and its thread aborts the process on its way back into
        Python. Not after an uncaught exception: the peers may be waiting inside a step, and the
        launcher ends the job on this rank's exit, which must not wait for them.
        """
        if hasattr(sys, "last_value") or hasattr(sys, "last_exc"):
            return
        self.close(min(self.group.timeout, _EXIT_WAIT_S))

    def close(self, timeout: float | None = None) -> None:
        """Stop serving (every rank of the pipeline calls this, or exits) and restore the
        modules."""
        if self._stall is not None:
            self._stall.stop()
        if self.transport is not None:
            atexit.unregister(self._close_at_exit)
            self.transport.close(timeout)
        if self._dispatcher is not None:  # after the receivers: nothing more comes
            self._dispatcher.close(self.group.timeout if timeout is None else timeout)
        for module in self._modules.values():
            remove_stub(module)
        sys.setswitchinterval(self._switch_interval)

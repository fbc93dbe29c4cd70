"""One rank's side of a pipeline: serving the modules it owns, calling the others', running steps.

The leader (pp rank 0) runs the step body once per microbatch, each in its own task; calls to
modules owned elsewhere become requests to their owners (:mod:`dtrain.modelparallel.remote`).
A request nobody waits for yet (a deferred call) waits in its task's outbox and travels with the
task's next request to the same owner, in one message. Every rank serves the requests it
receives in tasks of its own (one per message, its requests in order), so a module can call
back into the caller's rank, and several microbatches are in flight on all partitions at once.
The executor's compute token decides which task computes next (the pipeline schedule's
policy). When the leader's microbatches are done it sends their results to the other ranks of
the pipeline, which return them from the step too.

What an owner computed for a call stays with it (:class:`_Served`) until the call's microbatch
ends (the leader's next request says so, or the step's end): later calls may refer to its
outputs, callers may fetch them, and backward starts from them. Calls linked by such
references form a *chain* whose autograd graph lives on the owner; one backward runs through the
whole chain, keeping the graph only when the chain has several fetched outputs (each may bring
its own backward).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.modelparallel.errors import (
    CommunicationTimeoutError,
    ModelParallelError,
    NotInStepError,
    RemoteError,
    StepFailedError,
)
from dtrain.modelparallel.executor import Executor, MicrobatchResult, Task
from dtrain.modelparallel.hooks import Record, hooked_submodules, owners_hooks, recording, replay
from dtrain.modelparallel.modes import ComputeMode
from dtrain.modelparallel.options import RuntimeOptions
from dtrain.modelparallel.policy import Phase, SchedulePolicy
from dtrain.modelparallel.remote import (
    CallRecord,
    LeafId,
    RemoteValue,
    attach,
    call_signature,
    check_prediction,
    deferred_outputs,
    install_stub,
    materialize,
    predictable,
    remove_stub,
    resolve_output,
)
from dtrain.modelparallel.split_backward import WeightHalf, backward_inputs_first
from dtrain.modelparallel.stall import RankState, StallWatch, WaitBoard, default_store
from dtrain.modelparallel.transport import (
    BACKWARD,
    END_STEP,
    ERROR,
    FETCH,
    FORWARD,
    REPLY,
    Message,
    OutputRef,
    Pending,
    Transport,
    error_body,
    flatten,
    map_leaves,
    unflatten,
)

_POLL_S = 0.5
_EXIT_WAIT_S = 60.0
"""Longest a rank that reaches the end of its script waits for its peers to reach theirs."""

GIL_SWITCH_INTERVAL_S = 0.0005
"""Python hands the GIL to a waiting thread after this long (default 5 ms). A rank's receiver
and its tasks take turns at every message, and each turn costing up to 5 ms would stall the
whole pipeline behind whichever thread runs Python code."""

MAX_PREDICTIONS = 4096
"""Output structures remembered per rank (a module called with ever new non-tensor arguments,
a step counter say, would otherwise grow the table without end)."""

CallKey = tuple[int, int]
"""A served call: (caller's global rank, call id)."""


@dataclass(eq=False)
class _Chain:
    """Served calls linked by output references, and how many of their outputs were fetched."""

    members: list[CallKey]
    fetched: int = 0


@dataclass(eq=False)
class _Served:
    """What the owner keeps of a forward call it serves, until the call's microbatch ends."""

    module: str
    step: int
    microbatch: int
    chain: _Chain
    done: threading.Event = field(default_factory=threading.Event)
    output: Any = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    """The tensors the caller sent, by index (the leaves of the chain's graph)."""
    error: BaseException | None = None


def _dequeue(task: Task, dst: int) -> list[tuple[Message, list[torch.Tensor]]]:
    """Take the requests ``task`` queued for global rank ``dst`` out of its outbox, in order."""
    items = [(message, tensors) for peer, message, tensors in task.outbox if peer == dst]
    task.outbox = [item for item in task.outbox if item[0] != dst]
    return items


def _loss_gradient(
    output: torch.Tensor, grad: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """The gradient ``model.backward`` starts from, with the errors ``Tensor.backward`` gives."""
    if not output.requires_grad:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    if grad is None:
        if scale is None and output.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        grad = torch.ones_like(output)
    return grad if scale is None else grad * scale


@dataclass(frozen=True)
class PipelineGroup:
    """Where this rank sits: its pipeline's global ranks (index = pp rank) and process groups."""

    rank: int
    pp_rank: int
    ranks: list[int]
    control_group: dist.ProcessGroup | None
    data_group: dist.ProcessGroup | None
    device: torch.device
    timeout: float


class PipelineRuntime:
    """Serves, calls and steps for one rank; built once the partition plan is known."""

    def __init__(
        self,
        group: PipelineGroup,
        modules: dict[str, nn.Module],
        owners: dict[str, int],
        policy: SchedulePolicy,
        options: RuntimeOptions,
    ) -> None:
        self.group = group
        self.owners = owners
        self._modules = modules
        self.policy = policy
        self.executor = Executor(group.pp_rank, policy, group.timeout, self._flush)
        self._served: dict[CallKey, _Served] = {}
        self._served_lock = threading.Lock()
        self._predictions: dict[str, Any] = {}
        self._releases: dict[int, list[tuple[int, int]]] = {}
        self._releases_lock = threading.Lock()
        self._defer = options.defer
        self._weights_failure: ModelParallelError | None = None
        self._inbox: queue.Queue[tuple[Message, list[torch.Tensor]]] = queue.Queue()
        self._order_lock = threading.Lock()
        self._ended = 0
        """The last of the leader's steps whose end this rank has received."""
        self._early: list[list[tuple[Message, list[torch.Tensor]]]] = []
        """Request streams of a step that began here before the previous one ended."""
        self._steps = 0
        self.transport: Transport | None = None
        self.waits = WaitBoard()
        """This rank's waits on other ranks, for stall reports."""
        self._stall: StallWatch | None = None
        self._switch_interval = sys.getswitchinterval()
        """The interpreter's, restored at close."""
        if len(group.ranks) > 1:
            sys.setswitchinterval(min(self._switch_interval, GIL_SWITCH_INTERVAL_S))
            assert group.control_group is not None and group.data_group is not None
            self.transport = Transport(
                group.rank,
                group.ranks,
                group.control_group,
                group.data_group,
                group.device,
                group.timeout,
                self._on_messages,
            )
            atexit.register(self._close_at_exit)
            self._stall = self._watch_stalls(options.stall_report)
        self._subtrees = {
            name: [
                (inner, submodule)
                for inner, submodule in modules.items()
                if inner.startswith(f"{name}." if name else "")
                and inner != name
                and owners[inner] != group.pp_rank
            ]
            for name in modules
            if owners[name] != group.pp_rank
        }
        """Per module run elsewhere: its submodules not run here (whose hooks are replayed)."""
        for name, module in modules.items():
            if owners[name] != group.pp_rank:
                install_stub(module, self._stub(name))
            elif name:
                install_stub(module, self._guard(name, module.forward))

    @property
    def is_leader(self) -> bool:
        return self.group.pp_rank == 0

    def _watch_stalls(self, limit: float) -> StallWatch:
        transport = self.transport
        assert transport is not None
        watch = StallWatch(
            rank=self.group.rank,
            ranks=self.group.ranks,
            limit=limit,
            last_progress=lambda: max(transport.last_activity, self.executor.last_progress),
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
        report = self._stall.report if self._stall is not None else None
        if isinstance(error, CommunicationTimeoutError) and report:
            explained = CommunicationTimeoutError(f"{error}\n{report}")
            explained.__cause__ = error
            return explained
        return error

    # --- calling modules on other ranks ------------------------------------------------------

    def _stub(self, name: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            task = self.executor.current()
            if task is None:
                raise NotInStepError(
                    f"module {name or '<root>'!r} was called outside an @smp.step function: "
                    "call the model (and model.backward) inside the step function"
                )
            return self._call(task, name, self.owners[name], args, kwargs)

        return forward

    def _guard(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        """An owned module computes with the token; when called from code that holds it
        already (its parent's forward) this costs nothing (see :mod:`.executor`). Deferred
        remote values among its arguments are fetched first."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = materialize((args, kwargs))
            with self.executor.computing(name):
                return forward(*args, **kwargs)

        return guarded

    def _call(
        self, task: Task, name: str, owner: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``module(*args, **kwargs)`` on partition ``owner`` (see :mod:`.remote`)."""
        assert self.transport is not None
        refs: list[CallRecord] = []

        def pass_value(value: Any) -> Any:
            if isinstance(value, RemoteValue):
                reference = value.reference_for(owner)
                if reference is None:
                    return value.fetch()
                refs.append(value.record)
                return reference
            return value

        structure, tensors = flatten(map_leaves((args, kwargs), pass_value))
        signature = call_signature(name, structure)
        observed = hooked_submodules(name, self._subtrees[name])
        # A call whose hooks are replayed here waits for its records: never deferred.
        predicted = self._predictions.get(signature) if self._defer and not observed else None
        mode = ComputeMode.current()
        call_id = self.transport.next_call_id()
        message = Message(
            FORWARD,
            call_id,
            module=name,
            body=structure,
            microbatch=task.microbatch,
            step=task.step,
            extra={"mode": mode.to_wire(), "expect": predicted, "observe": observed},
        )
        dst = self.group.ranks[owner]
        if predicted is None:
            pending = self._request(dst, message, tensors)
        else:  # nobody waits for it: it goes with the task's next request or before it blocks
            pending = self.transport.expect(dst, message)
            task.outbox.append((dst, message, tensors))
        record = CallRecord(
            self, name, owner, call_id, mode.grad, tensors, refs, pending, predicted
        )
        task.calls.append(record)
        if predicted is not None:
            return deferred_outputs(record, predicted)
        outputs = record.reply()
        if observed:
            self._replay_hooks(record)
        if predictable(outputs):
            if len(self._predictions) >= MAX_PREDICTIONS:  # arguments that never repeat
                self._predictions.clear()
            self._predictions[signature] = outputs
        return attach(record, (), outputs, record.outputs, record.meta)

    def _replay_hooks(self, record: CallRecord) -> None:
        """Run this rank's hooks of the submodules the owner recorded (see :mod:`.hooks`); the
        records' tensors follow the outputs in the reply."""
        extra = record.extra
        first = extra["records_from"]
        tensors, meta = record.outputs[first:], record.meta[first:]
        record.outputs, record.meta = record.outputs[:first], record.meta[:first]
        differentiable = [m.requires_grad for m in meta]
        replay(self._modules, extra["records"], tensors, differentiable, set(extra["native"]))

    def _request(self, dst: int, message: Message, tensors: list[torch.Tensor]) -> Pending:
        """Send a request to global rank ``dst``, after the requests the current task queued
        for it (in the same stream), and the task's other queued requests."""
        assert self.transport is not None
        pending = self.transport.expect(dst, message)
        task = self.executor.current()
        queued = []
        if task is not None and task.outbox:
            queued = _dequeue(task, dst)
            self._flush(task)
        self._send_all(dst, [*queued, (message, tensors)])
        return pending

    def _flush(self, task: Task) -> None:
        """Send the requests ``task`` queued, one stream per peer."""
        while task.outbox:
            dst = task.outbox[0][0]
            self._send_all(dst, _dequeue(task, dst))

    def _send_all(self, dst: int, items: list[tuple[Message, list[torch.Tensor]]]) -> None:
        """Send requests in one stream; the microbatches released since the last request to
        ``dst`` travel along (their kept calls are dropped there on arrival)."""
        assert self.transport is not None
        with self._releases_lock:
            released = self._releases.pop(dst, None)
        if released:
            items[0][0].extra["released"] = released
        try:
            self.transport.send_all(dst, items)
        except BaseException:
            for message, _ in items:
                self.transport.forget(message.call_id)
            raise

    def wait(self, pending: Pending) -> tuple[Message, list[torch.Tensor]]:
        """A reply, giving the compute token away meanwhile."""
        with self.executor.waiting(), self.waits.waiting(pending.peer, pending.request.describe()):
            return pending.wait(self.group.timeout, self.group.rank)

    def forget(self, record: CallRecord) -> None:
        """The call is settled: no reply to it will be waited for."""
        assert self.transport is not None
        self.transport.forget(record.call_id)

    def _ask(
        self, kind: str, record: CallRecord, body: dict[str, Any], tensors: list[torch.Tensor]
    ) -> tuple[Message, list[torch.Tensor]]:
        """A request about ``record``'s kept outputs; a failure of the call itself is reported
        as the call's own error (the owner sends it before answering anything about the call).
        Success means the call and those it referenced succeeded."""
        assert self.transport is not None
        request = Message(
            kind,
            self.transport.next_call_id(),
            module=record.module,
            body={"call": record.call_id, **body},
            microbatch=record.pending.request.microbatch,
            step=record.pending.request.step,
            extra={"mode": ComputeMode.current().to_wire()},
        )
        try:
            reply = self.wait(self._request(self.group.ranks[record.owner], request, tensors))
        except RemoteError:
            failure = record.failure()
            if failure is not None:
                raise failure from None
            raise
        failure = record.failure()  # confirmed after it was dropped: it may have failed before
        if failure is not None:
            raise failure
        record.succeeded()
        return reply

    def fetch(self, record: CallRecord, path: tuple[Any, ...]) -> Any:
        """The value at ``path`` of a deferred call's outputs, from its owner."""
        reply, tensors = self._ask(FETCH, record, {"path": path}, [])
        return attach(record, path, reply.body, tensors, reply.meta)

    def confirm(self, record: CallRecord) -> None:
        """Wait until the owner has finished a deferred call nobody fetched from (its error
        raises)."""
        self._ask(FETCH, record, {"path": None}, [])

    def backward_call(
        self,
        record: CallRecord,
        path: tuple[Any, ...],
        leaves: list[LeafId],
        grads: list[torch.Tensor | None],
    ) -> list[torch.Tensor | None]:
        """Backward from a fetched value on its owner; the gradients of the sent ``leaves``."""
        _, input_grads = self._backward_request(record, path, leaves, grads, {})
        return input_grads

    def backward_deferred(
        self, value: RemoteValue, grad: torch.Tensor | None, scale: float | None
    ) -> None:
        """``model.backward`` of a value not fetched yet (a loss computed on another partition):
        one request fetches it and runs its backward on the owner (its gradient ``grad``, or
        ones, times ``scale``); the gradients of what this rank sent into its chain continue
        the backward here."""
        record = value.record
        leaves, inputs = record.closure()
        fetched, input_grads = self._backward_request(
            record, value.path, leaves, [grad], {"fetch": True, "scale": scale}
        )
        assert fetched is not None
        value.resolve(fetched)
        pairs = [(t, g) for t, g in zip(inputs, input_grads, strict=True) if g is not None]
        if pairs:
            with self.executor.backward():
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _backward_request(
        self,
        record: CallRecord,
        path: tuple[Any, ...],
        leaves: list[LeafId],
        grads: list[torch.Tensor | None],
        options: dict[str, Any],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """The fetched value (if ``options`` ask for it) and the gradients of ``leaves``."""
        body = {"path": path, "leaves": leaves, "present": [g is not None for g in grads]}
        reply, tensors = self._ask(
            BACKWARD, record, {**body, **options}, [g for g in grads if g is not None]
        )
        received = iter(tensors)
        fetched = next(received) if options.get("fetch") else None
        return fetched, [next(received) if present else None for present in reply.body["present"]]

    def check_calls(self, task: Task) -> None:
        """Wait until every call ``task`` made is known to have succeeded (errors raise here,
        the earliest call's first)."""
        try:
            while task.calls:
                task.calls[0].reply()
                task.calls.pop(0)
        finally:
            self.drop_calls(task)

    def drop_calls(self, task: Task) -> None:
        """Forget the calls of ``task`` that are not settled (it failed): replies to them are
        no longer awaited."""
        for record in task.calls:
            self.forget(record)
        task.calls.clear()
        task.outbox.clear()

    # --- serving calls from other ranks ------------------------------------------------------

    def _on_messages(self, messages: list[tuple[Message, list[torch.Tensor]]]) -> None:
        """A receiver thread (one per peer): the requests of one stream (one caller's, in its
        order) are served one after the other by one task; step ends and failures go to the inbox.

        Serving them in order cannot deadlock: a request can only depend on earlier ones (the
        caller sent it after them, never waiting in between). Messages from different peers are
        not ordered with each other: a request of the leader's next step that another rank sent
        before this rank got the end of the current step waits for that end, so that this rank
        finishes its own work of the step (e.g. ``optimizer.step()``) first.
        """
        first = messages[0][0]
        if not self.is_leader and first.kind in (FORWARD, FETCH, BACKWARD):
            with self._order_lock:
                if first.step > self._ended + 1:
                    self._early.append(messages)
                    return
        jobs: list[tuple[Phase, Callable[[], None]]] = []
        for message, tensors in messages:
            for step, microbatch in message.extra.get("released", ()):
                self._forget_microbatch(step, microbatch)
            if message.kind == FORWARD:
                key = (message.source, message.call_id)
                entry = _Served(message.module, message.step, message.microbatch, _Chain([key]))
                with self._served_lock:
                    self._served[key] = entry
                jobs.append(("F", functools.partial(self._serve_forward, message, tensors, entry)))
            elif message.kind == FETCH:
                serve = functools.partial(self._reply, message, self._serve_fetch, message)
                jobs.append(("F", serve))
            elif message.kind == BACKWARD:
                jobs.append(("B", functools.partial(self._serve_backward, message, tensors)))
            elif message.kind == END_STEP and not self.is_leader:
                due = self._end_of_step(message.call_id)
                self._inbox.put((message, tensors))
                for stream in due:
                    self._on_messages(stream)
            else:
                if not self.is_leader:
                    self.executor.reclaim_main()
                self._inbox.put((message, tensors))
        if jobs:
            task = Task("serve", first.microbatch, step=first.step)
            self.executor.spawn(functools.partial(self._serve_stream, task, jobs))

    def _end_of_step(self, step: int) -> list[list[tuple[Message, list[torch.Tensor]]]]:
        """The leader ended ``step``: the main task gets the token before any request of the
        next step; returns the next step's requests that came early, to be served now."""
        with self._order_lock:
            self.executor.reclaim_main()
            self._ended = step
            due = [stream for stream in self._early if stream[0][0].step <= step + 1]
            self._early = [stream for stream in self._early if stream[0][0].step > step + 1]
        return due

    def _serve_stream(self, task: Task, jobs: list[tuple[Phase, Callable[[], None]]]) -> None:
        """One stream's requests, in order, as one task (all of one microbatch)."""
        with self.executor.serving(task):
            for phase, job in jobs:
                task.phase = phase
                job()

    def _reply(
        self, request: Message, serve: Callable[..., tuple[Any, list[torch.Tensor]]], *args: Any
    ) -> None:
        """Run ``serve`` and send its result (or its error) back to the requester."""
        try:
            body, tensors = serve(*args)
        except BaseException as exc:
            self._send_error(request, exc)
        else:
            self._send_reply(request, Message(REPLY, request.call_id, body=body), tensors)

    def _send_error(self, request: Message, exc: BaseException) -> None:
        error = Message(ERROR, request.call_id, body=error_body(self.group.rank, exc))
        self._send_reply(request, error, [])

    def _send_reply(
        self,
        request: Message,
        reply: Message,
        tensors: list[torch.Tensor],
        step_aside: bool = True,
    ) -> None:
        """Send a reply; a task holding the token between computations lets a waiting task
        compute meanwhile (``step_aside``)."""
        assert self.transport is not None
        if step_aside:
            self.executor.step_aside()
        with contextlib.suppress(ModelParallelError):  # broken pipeline: the caller's wait says so
            self.transport.send(request.source, reply, tensors)

    def _serve_forward(self, message: Message, tensors: list[torch.Tensor], entry: _Served) -> None:
        """Compute a call; reply with its outputs if eager, only with an error if deferred.

        A failure is sent before the call counts as finished, so it reaches the caller before
        the answer to any later request that uses the call's outputs.
        """
        predicted = message.extra.get("expect")
        try:
            output, records = self._compute_forward(message, tensors, entry)
            structure, outputs = flatten(output)
            if predicted is not None:
                check_prediction(message.module, structure, predicted)
        except BaseException as exc:
            entry.error = exc
            self._send_error(message, exc)
            return
        finally:
            entry.done.set()
        if predicted is None:
            with self._served_lock:
                entry.chain.fetched += 1
            reply = Message(REPLY, message.call_id, body=structure)
            if message.extra["observe"]:
                recorded, recorded_tensors = flatten(records)
                reply.extra = {
                    "records": recorded,
                    "records_from": len(outputs),
                    "native": owners_hooks(self._modules, message.extra["observe"]),
                }
                outputs = [*outputs, *recorded_tensors]
            self._send_reply(message, reply, outputs)

    def _compute_forward(
        self, message: Message, tensors: list[torch.Tensor], entry: _Served
    ) -> tuple[Any, list[Record]]:
        """The call's output, and the calls of the submodules the caller replays hooks of."""
        mode = ComputeMode.from_wire(message.extra["mode"])
        entry.inputs = [
            t.requires_grad_() if meta.requires_grad and mode.grad else t
            for t, meta in zip(tensors, message.meta, strict=True)
        ]
        # Referenced outputs may still be computing: wait for them before taking the token.
        structure = map_leaves(message.body, lambda v: self._referenced(message.source, v, entry))
        args, kwargs = unflatten(structure, entry.inputs)
        task = self.executor.current()
        assert task is not None
        with self.executor.computing(message.module):
            with mode.applied(), recording(self._modules, message.extra["observe"]) as records:
                output = materialize(self._modules[message.module](*args, **kwargs))
            self.check_calls(task)
        entry.output = output
        return output, records

    def _referenced(self, source: int, value: Any, entry: _Served) -> Any:
        """An argument as the owner has it: a referenced output joins the caller's chain."""
        if not isinstance(value, OutputRef):
            return value
        other = self._finished_entry((source, value.call_id))
        self._join(entry, other)
        return resolve_output(other.output, value.path, other.module)

    def _join(self, entry: _Served, other: _Served) -> None:
        with self._served_lock:
            if entry.chain is other.chain:
                return
            keep, gone = sorted((entry.chain, other.chain), key=lambda c: -len(c.members))
            keep.members.extend(gone.members)
            keep.fetched += gone.fetched
            for key in gone.members:
                member = self._served.get(key)
                if member is not None:
                    member.chain = keep

    def _served_entry(self, key: CallKey, what: str) -> _Served:
        with self._served_lock:
            entry = self._served.get(key)
        if entry is None:
            raise ModelParallelError(
                f"rank {self.group.rank}: {what} from rank {key[0]} is no longer kept (its "
                "microbatch ended, or it ran without grad and backward came anyway)"
            )
        return entry

    def _finished_entry(self, key: CallKey) -> _Served:
        """A served call once it has finished; raises if it failed or does not finish in time."""
        entry = self._served_entry(key, f"output of call #{key[1]}")
        if not entry.done.is_set():
            with self.executor.waiting():  # it computes with the token
                entry.done.wait(self.group.timeout)
        if not entry.done.is_set():
            raise CommunicationTimeoutError(
                f"rank {self.group.rank}: call #{key[1]} of module {entry.module!r} did not "
                f"finish within {self.group.timeout:g} s"
            )
        if entry.error is not None:  # its own type, rank and traceback, not this request's
            raise error_body(self.group.rank, entry.error)
        return entry

    def _serve_fetch(self, message: Message) -> tuple[Any, list[torch.Tensor]]:
        """A kept output, or (``path`` None) that the call finished: if it is no longer kept,
        it finished and a failure was reported before this answer."""
        key = (message.source, message.body["call"])
        path = message.body["path"]
        if path is None:
            with self._served_lock:
                kept = key in self._served
            if kept:
                self._finished_entry(key)
            return None, []
        entry = self._finished_entry(key)
        with self._served_lock:
            entry.chain.fetched += 1
        return flatten(resolve_output(entry.output, path, entry.module))

    def _serve_backward(self, message: Message, tensors: list[torch.Tensor]) -> None:
        """Backward of a chain; the reply carries its inputs' gradients.

        In the step's last microbatch (where the stages before this one wait for those
        gradients and then still have their own backward to do) the inputs' gradients are
        computed first and sent, then the weights' (:mod:`.split_backward`). The task keeps the
        token from the first half to the end of the second, so the step cannot end on this
        rank (nor the optimizer step start) before every weight gradient is in.
        """
        try:
            # Before computing: a value fetched with its backward may still be computing.
            entry = self._finished_entry((message.source, message.body["call"]))
            with self.executor.computing(message.module):
                with ComputeMode.from_wire(message.extra["mode"]).applied():
                    body, grads, weights = self._compute_backward(message, tensors, entry)
                if weights is not None:
                    reply = Message(REPLY, message.call_id, body=body)
                    self._send_reply(message, reply, grads, step_aside=False)
                    self.executor.next_period(f"{message.module} (weights)")
                    self._run_weights(message, weights)
                    return
        except BaseException as exc:
            self._send_error(message, exc)
            return
        self._send_reply(message, Message(REPLY, message.call_id, body=body), grads)

    def _run_weights(self, message: Message, weights: WeightHalf) -> None:
        """The weight half of a split backward; its failure fails this rank's step."""
        try:
            weights.run()
        except BaseException as exc:
            self._weights_failure = error_body(self.group.rank, exc)

    def _own_parameters(self) -> Iterator[nn.Parameter]:
        for name, module in self._modules.items():
            if self.owners[name] == self.group.pp_rank:
                yield from module.parameters(recurse=False)

    def _compute_backward(
        self, message: Message, tensors: list[torch.Tensor], entry: _Served
    ) -> tuple[Any, list[torch.Tensor], WeightHalf | None]:
        """Backward from the outputs at ``path`` down to the chain's ``leaves``; with ``fetch``
        (a deferred value's ``model.backward``) the value goes back too, and its gradient is
        ``scale`` times the one sent, or ones. Split (see :meth:`_serve_backward`), the weight
        half comes back to be run after the reply."""
        source, body = message.source, message.body
        _, outputs = flatten(resolve_output(entry.output, body["path"], entry.module))
        received = iter(tensors)
        grads = [next(received) if present else None for present in body["present"]]
        fetched = []
        if body.get("fetch"):
            with self._served_lock:
                entry.chain.fetched += 1
            grads = [_loss_gradient(outputs[0], grads[0], body["scale"])]
            fetched = [outputs[0].detach()]
        leaves = [
            self._served_entry((source, call), f"call #{call}").inputs[index]
            for call, index in body["leaves"]
        ]
        for leaf in leaves:
            leaf.grad = None
        pairs = [
            (out, g)
            for out, g in zip(outputs, grads, strict=True)
            if g is not None and out.requires_grad
        ]
        keep_graph = entry.chain.fetched > 1  # another fetched output may bring a backward
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        weights = None
        if pairs and wanted and not keep_graph and self.policy.splits_backward(message.microbatch):
            found, half = backward_inputs_first(
                [out for out, _ in pairs], [g for _, g in pairs], wanted, self._own_parameters()
            )
            weights = half if half.groups else None  # ran whole, or no weights to wait for
            by_leaf = dict(zip(map(id, wanted), found, strict=True))
            input_grads = [by_leaf.get(id(leaf)) for leaf in leaves]
        else:
            if pairs:
                torch.autograd.backward(
                    [out for out, _ in pairs], [g for _, g in pairs], retain_graph=keep_graph
                )
            input_grads = [leaf.grad if leaf.requires_grad else None for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        if not keep_graph:
            self._forget_chain(entry.chain)
        present = [g is not None for g in input_grads]
        return {"present": present}, fetched + [g for g in input_grads if g is not None], weights

    def _forget_chain(self, chain: _Chain) -> None:
        """Drop a chain after its backward; a member still computing (joined the chain, its
        outputs unused) stays until it finishes, so a confirmation of it can wait for it."""
        with self._served_lock:
            for key in chain.members:
                entry = self._served.get(key)
                if entry is not None and entry.done.is_set():
                    del self._served[key]

    def _forget_microbatch(self, step: int, microbatch: int) -> None:
        """The leader finished this microbatch: nothing of it is needed any more."""
        with self._served_lock:
            for key in [
                k for k, v in self._served.items() if (v.step, v.microbatch) == (step, microbatch)
            ]:
                del self._served[key]

    # --- steps -------------------------------------------------------------------------------

    def run_step(self, count: int, body: Callable[[int], Any] | None) -> list[MicrobatchResult]:
        """Every rank of the pipeline: the leader runs ``body`` per microbatch, others serve.

        Returns each microbatch's outcome on every rank; a failure on the leader comes back as
        ``(False, error)`` on all ranks.
        """
        self._steps += 1
        self.executor.clear_timeline()
        if self.is_leader:
            assert body is not None
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
                self._forget_served(None)
            outcomes = [(ok, value if ok else self._explained(value)) for ok, value in outcomes]
            self._announce(outcomes)
            self._raise_weights_failure()
            return outcomes
        try:
            outcomes, ended = self._await_step_end()
        except CommunicationTimeoutError as exc:
            raise self._explained(exc) from exc
        self._forget_served(ended)
        self._raise_weights_failure()
        return outcomes

    def _raise_weights_failure(self) -> None:
        failure, self._weights_failure = self._weights_failure, None
        if failure is not None:
            raise failure

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
            self.check_calls(task)
            return result
        finally:
            self.drop_calls(task)
            self._release(task.step, microbatch)

    def _release(self, step: int, microbatch: int) -> None:
        """Nothing of this microbatch is needed any more: the other ranks learn it with the
        next request they get (or the step's end, which drops everything kept)."""
        self._forget_microbatch(step, microbatch)
        if self.transport is None:
            return
        with self._releases_lock:
            for peer in self.transport.peers:
                self._releases.setdefault(peer, []).append((step, microbatch))

    def _forget_served(self, step: int | None) -> None:
        """Drop kept forwards whose backward never came (evaluation, unused outputs): all of them
        on the leader, where nothing else runs once its microbatches are done; on another rank
        those of the leader's steps up to ``step``, which has just ended (the rank may already
        serve the next one)."""
        with self._served_lock:
            if step is None:
                self._served.clear()
            else:
                for key in [k for k, v in self._served.items() if v.step <= step]:
                    del self._served[key]

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
        with self._releases_lock:
            self._releases.clear()  # the step's end drops what the others kept of it
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

    # --- teardown ----------------------------------------------------------------------------

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
        for module in self._modules.values():
            remove_stub(module)
        sys.setswitchinterval(self._switch_interval)

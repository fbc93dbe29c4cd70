"""Calling the modules other ranks own: the caller's side of a pipeline rank.

On this rank a module owned elsewhere has a stub for its ``forward`` (:meth:`RemoteCaller.stub`)
that sends the call to the owner (see :mod:`.remote` for eager and deferred calls). A deferred
call waits in its task's outbox and travels with the task's next request to the same owner, in
one message. The microbatches the leader has finished travel with the next request to each
peer too (their kept calls are dropped there). Forward hooks of submodules the owner runs are
replayed here from its records (:mod:`.hooks`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from dtrain.modelparallel.errors import ModelParallelError, NotInStepError, RemoteError
from dtrain.modelparallel.modules.activations import CheckpointSpec
from dtrain.modelparallel.modules.checkpoint import (
    inside_non_reentrant_checkpoint,
    inside_reentrant_checkpoint,
    take,
)
from dtrain.modelparallel.modules.modes import ComputeMode
from dtrain.modelparallel.modules.stubs import REMOTE_STUB
from dtrain.modelparallel.modules.unfetched import materialize
from dtrain.modelparallel.pipeline.executor import Task
from dtrain.modelparallel.pipeline.group import RankParts
from dtrain.modelparallel.pipeline.hooks import hooked_submodules, replay
from dtrain.modelparallel.pipeline.remote import (
    CallRecord,
    LeafId,
    RemoteValue,
    attach,
    call_signature,
    deferred_outputs,
    predictable,
)
from dtrain.modelparallel.pipeline.split_backward import backward_giving_way
from dtrain.modelparallel.pipeline.stall import WaitBoard
from dtrain.modelparallel.transport.message import (
    BACKWARD,
    FETCH,
    FORWARD,
    Message,
    Pending,
    TensorMeta,
)
from dtrain.modelparallel.transport.structure import flatten, map_leaves

MAX_PREDICTIONS = 4096
"""Output structures remembered per rank (a module called with ever new non-tensor arguments,
a step counter say, would otherwise grow the table without end)."""


def _dequeue(task: Task, dst: int) -> list[tuple[Message, list[torch.Tensor]]]:
    """Take the requests ``task`` queued for global rank ``dst`` out of its outbox, in order."""
    items = [(message, tensors) for peer, message, tensors in task.outbox if peer == dst]
    task.outbox = [item for item in task.outbox if item[0] != dst]
    return items


def _refuse_deferred_arguments(name: str, owner: int, arguments: Any) -> None:
    """A call inside reentrant ``torch.utils.checkpoint`` gives the checkpoint function tensors
    (its outputs are fetched at once); an argument another partition computed and nobody
    fetched yet is no tensor to that function, which would drop its gradient: refused."""
    deferred: list[RemoteValue] = []
    map_leaves(arguments, lambda v: deferred.append(v) if isinstance(v, RemoteValue) else None)
    for value in deferred:
        if not value.fetched and value.record.grad:
            raise ModelParallelError(
                f"module {name!r} (partition {owner}) is called inside reentrant "
                "torch.utils.checkpoint with an argument that module "
                f"{value.record.module!r} computed on partition {value.record.owner} and nobody "
                "fetched: it is not a tensor there, so reentrant checkpointing would drop its "
                "gradient. Use use_reentrant=False, or "
                f"smp.set_activation_checkpointing(<module {name!r}>) instead"
            )


class RemoteCaller:
    """This rank's calls to modules other partitions own; the :class:`~.remote.Caller` of the
    :class:`~.remote.CallRecord` of each."""

    def __init__(self, parts: RankParts, waits: WaitBoard) -> None:
        self.group, self.transport, self.executor = parts.group, parts.transport, parts.executor
        self.owners, self._modules = parts.owners, parts.modules
        self.waits = waits
        self._predictions: dict[str, Any] = {}
        self._releases: dict[int, list[tuple[int, int]]] = {}
        self._releases_lock = threading.Lock()
        here = self.group.pp_rank
        self._subtrees = {
            name: [
                (inner, submodule)
                for inner, submodule in module.named_modules(prefix=name)
                if inner != name and self.owners.get(inner, here) != here
            ]
            for name, module in self._modules.items()
            if self.owners[name] != here
        }
        """Per module run elsewhere: its submodules not run here (whose hooks are replayed)."""

    def stub(self, name: str) -> Callable[..., Any]:
        module, owner = self._modules[name], self.owners[name]

        def forward(*args: Any, **kwargs: Any) -> Any:
            task = self.executor.current()
            if task is None:
                raise NotInStepError(
                    f"module {name or '<root>'!r} was called outside an @smp.step function: "
                    "call the model (and model.backward) inside the step function"
                )
            spec = take(module)
            if spec is None and inside_non_reentrant_checkpoint():
                spec = CheckpointSpec()  # the owner checkpoints it (see ..modules.checkpoint)
            if not inside_reentrant_checkpoint():
                return self.call(task, name, owner, args, kwargs, spec)
            _refuse_deferred_arguments(name, owner, (args, kwargs))
            return materialize(self.call(task, name, owner, args, kwargs, spec))

        setattr(forward, REMOTE_STUB, True)
        return forward

    def call(
        self,
        task: Task,
        name: str,
        owner: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        checkpoint: CheckpointSpec | None = None,
    ) -> Any:
        """Run ``module(*args, **kwargs)`` on partition ``owner`` (see :mod:`.remote`),
        checkpointed there if ``checkpoint`` says so."""
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
        predicted = None if observed else self._predictions.get(signature)
        mode = ComputeMode.current()
        call_id = self.transport.next_call_id()
        message = Message(
            FORWARD,
            call_id,
            module=name,
            body=structure,
            microbatch=task.microbatch,
            step=task.step,
            extra={
                "mode": mode.to_wire(),
                "expect": predicted,
                "observe": observed,
                "checkpoint": None if checkpoint is None else checkpoint.preserve_rng_state,
            },
        )
        dst = self.group.ranks[owner]
        self.executor.notices.moved_on(task, owner)
        if predicted is None:
            pending = self.request(dst, message, tensors)
        else:  # nobody waits for it: it goes with the task's next request or before it blocks
            pending = self.transport.expect(dst, message)
            task.outbox.append((dst, message, tensors))
        record = CallRecord(
            self, name, owner, call_id, mode.grad, tensors, refs, pending, predicted
        )
        task.calls.append(record)
        if predicted is not None:
            return deferred_outputs(record, predicted)
        outputs = record.reply(learning=not observed)
        if observed:
            self._replay_hooks(record)
        if predictable(outputs):
            if len(self._predictions) >= MAX_PREDICTIONS:  # arguments that never repeat
                self._predictions.clear()
            self._predictions[signature] = outputs
        self._note_graph(record, record.meta)
        # Handed over, not kept: the record is on the graph of the outputs it would keep.
        tensors, record.outputs = record.outputs, []
        return attach(record, (), outputs, tensors, record.meta)

    def _replay_hooks(self, record: CallRecord) -> None:
        """Run this rank's hooks of the submodules the owner recorded (see :mod:`.hooks`); the
        records' tensors follow the outputs in the reply."""
        extra = record.extra
        first = extra["records_from"]
        tensors, meta = record.outputs[first:], record.meta[first:]
        record.outputs, record.meta = record.outputs[:first], record.meta[:first]
        differentiable = [m.requires_grad for m in meta]
        replay(self._modules, extra["records"], tensors, differentiable, set(extra["native"]))

    def request(self, dst: int, message: Message, tensors: list[torch.Tensor]) -> Pending:
        """Send a request to global rank ``dst``, after the requests the current task queued
        for it (in the same stream), and the task's other queued requests."""
        assert self.transport is not None
        pending = self.transport.expect(dst, message)
        task = self.executor.current()
        queued = []
        if task is not None and task.outbox:
            queued = _dequeue(task, dst)
            self.flush(task)
        self._send_all(dst, [*queued, (message, tensors)])
        return pending

    def flush(self, task: Task) -> None:
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

    def wait(self, pending: Pending, reply: bool = False) -> tuple[Message, list[torch.Tensor]]:
        """A reply, giving the compute token away meanwhile (a ``WAIT`` on the timeline;
        ``reply``: a call's, awaited only to learn its outputs' structure, see
        :meth:`~..scheduling.ordering.PlannedOrdering.visit_over`)."""
        request = pending.request
        what = f"{request.label()} from rank {pending.peer}"
        with (
            self.executor.waiting(reply),
            self.waits.waiting(pending.peer, request.describe()),
            self.executor.recorder.span("WAIT", request.microbatch, what, pending.peer),
        ):
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
            reply = self.wait(self.request(self.group.ranks[record.owner], request, tensors))
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
        self._note_graph(record, reply.meta)
        return attach(record, path, reply.body, tensors, reply.meta)

    def _note_graph(self, record: CallRecord, meta: tuple[TensorMeta, ...]) -> None:
        """Outputs of ``record`` join the current task's autograd graph (:func:`.attach`): its
        backward may send the owner a backward request of the microbatch."""
        task = self.executor.current()
        if task is not None and record.grad and any(m.requires_grad for m in meta):
            task.remote_nodes[record.owner] += 1

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
        task = self.executor.current()
        if task is not None and task.sends_backward_to(record.owner):
            task.remote_nodes[record.owner] -= 1
        # The leader's graph holds every node that sends this owner its microbatch's backward.
        last = (
            task is not None and task.role == "leader" and not task.sends_backward_to(record.owner)
        )
        _, input_grads = self._backward_request(record, path, leaves, grads, {"last": last})
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
        task = self.executor.current()
        # The owner's last backward of the microbatch unless the graph here may send more.
        last = task is not None and not task.sends_backward_to(record.owner)
        fetched, input_grads = self._backward_request(
            record, value.path, leaves, [grad], {"fetch": True, "scale": scale, "last": last}
        )
        assert fetched is not None
        value.resolve(fetched)
        pairs = [(t, g) for t, g in zip(inputs, input_grads, strict=True) if g is not None]
        if pairs:
            with self.executor.backward():
                outputs, output_grads = [t for t, _ in pairs], [g for _, g in pairs]
                backward_giving_way(outputs, output_grads, self.executor.give_way)

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

    def release(self, step: int, microbatch: int) -> None:
        """The leader finished this microbatch: the other ranks learn it with the next request
        they get (or the step's end, which drops everything kept)."""
        if self.transport is None:
            return
        with self._releases_lock:
            for peer in self.transport.peers:
                self._releases.setdefault(peer, []).append((step, microbatch))

    def clear_releases(self) -> None:
        """The step's end drops what the others kept of it: no release is due any more."""
        with self._releases_lock:
            self._releases.clear()

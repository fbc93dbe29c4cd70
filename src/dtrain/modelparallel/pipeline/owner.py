"""Serving the calls other ranks make to this rank's modules: the owner's side of a pipeline rank.

Every rank serves the requests it receives in tasks of its own (one per stream of one caller,
its requests in order), so a module can call back into the caller's rank, and several
microbatches are in flight on all partitions at once.

What an owner computed for a call stays with it (:class:`Served`) until the call's microbatch
ends (the leader's next request says so, or the step's end): later calls may refer to its
outputs, callers may fetch them, and backward starts from them. Calls linked by such
references form a *chain* whose autograd graph lives on the owner; one backward runs through the
whole chain, keeping the graph only when the chain has several fetched outputs (each may bring
its own backward). A backward the policy splits sends its inputs' gradients first; its weights'
are computed later, when the rank has nothing more urgent to do (:mod:`.split_backward`,
:meth:`~.executor.Executor.owe_weights`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain.modelparallel.errors import CommunicationTimeoutError, ModelParallelError
from dtrain.modelparallel.modules.activations import CheckpointSpec, checkpointed
from dtrain.modelparallel.modules.checkpoint import requested, take
from dtrain.modelparallel.modules.modes import ComputeMode
from dtrain.modelparallel.modules.unfetched import materialize
from dtrain.modelparallel.pipeline.caller import RemoteCaller
from dtrain.modelparallel.pipeline.executor import Task
from dtrain.modelparallel.pipeline.group import RankParts
from dtrain.modelparallel.pipeline.hooks import Record, owners_hooks, recording
from dtrain.modelparallel.pipeline.remote import check_prediction, resolve_output
from dtrain.modelparallel.pipeline.split_backward import WeightHalf, backward_inputs_first
from dtrain.modelparallel.scheduling.policy import Phase, SchedulePolicy
from dtrain.modelparallel.transport.message import (
    BACKWARD,
    ERROR,
    FETCH,
    FORWARD,
    REPLY,
    Message,
    OutputRef,
    error_body,
)
from dtrain.modelparallel.transport.structure import flatten, map_leaves, unflatten

CallKey = tuple[int, int]
"""A served call: (caller's global rank, call id)."""


@dataclass(eq=False)
class Chain:
    """Served calls linked by output references, and how many of their outputs were fetched."""

    members: list[CallKey]
    fetched: int = 0


@dataclass(eq=False)
class Served:
    """What the owner keeps of a forward call it serves, until the call's microbatch ends."""

    module: str
    step: int
    microbatch: int
    chain: Chain
    done: threading.Event = field(default_factory=threading.Event)
    output: Any = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    """The tensors the caller sent, by index (the leaves of the chain's graph)."""
    error: BaseException | None = None


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


class Owner:
    """The calls this rank serves, from their arrival to the end of their microbatch."""

    def __init__(self, parts: RankParts, policy: SchedulePolicy, caller: RemoteCaller) -> None:
        self.group, self.transport, self.executor = parts.group, parts.transport, parts.executor
        self.owners, self._modules = parts.owners, parts.modules
        self.policy = policy
        self.caller = caller
        self._served: dict[CallKey, Served] = {}
        self._served_lock = threading.Lock()
        self._weights_failure: BaseException | None = None

    def accept(
        self, message: Message, tensors: list[torch.Tensor]
    ) -> tuple[Phase, Callable[[], None]]:
        """The job that serves a request (a forward is kept from now on, so later requests
        may refer to it)."""
        if message.kind == FORWARD:
            key = (message.source, message.call_id)
            entry = Served(message.module, message.step, message.microbatch, Chain([key]))
            with self._served_lock:
                self._served[key] = entry
            return "F", functools.partial(self._serve_forward, message, tensors, entry)
        if message.kind == FETCH:
            return "F", functools.partial(self._reply, message, self._serve_fetch, message)
        assert message.kind == BACKWARD, message.kind
        return "B", functools.partial(self._serve_backward, message, tensors)

    def guard(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        """An owned module computes with the token; when called from code that holds it
        already (its parent's forward) this costs nothing (see :mod:`.executor`). Deferred
        remote values among its arguments are fetched first. A call another rank asked to
        checkpoint (SMP's ``checkpoint(module, ...)``) runs checkpointed here."""
        module = self._modules[name]

        def guarded(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = materialize((args, kwargs))
            spec = take(module)
            run = forward if spec is None else checkpointed(forward, spec)
            if self.executor.computes_already():
                return run(*args, **kwargs)
            with self.executor.computing(name):
                return run(*args, **kwargs)

        return guarded

    def serve_stream(self, task: Task, jobs: list[tuple[Phase, Callable[[], None]]]) -> None:
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

    def _send_reply(self, request: Message, reply: Message, tensors: list[torch.Tensor]) -> None:
        """Send a reply; a task holding the token between computations lets a waiting task
        compute meanwhile."""
        assert self.transport is not None
        self.executor.step_aside()
        with contextlib.suppress(ModelParallelError):  # broken pipeline: the caller's wait says so
            self.transport.send(request.source, reply, tensors)

    def _serve_forward(self, message: Message, tensors: list[torch.Tensor], entry: Served) -> None:
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
        self, message: Message, tensors: list[torch.Tensor], entry: Served
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
        module = self._modules[message.module]
        preserve_rng_state = message.extra.get("checkpoint")
        spec = None if preserve_rng_state is None else CheckpointSpec(preserve_rng_state)
        with self.executor.computing(message.module):
            with (
                mode.applied(),
                recording(self._modules, message.extra["observe"]) as records,
                requested(module, spec),
            ):
                output = materialize(module(*args, **kwargs))
            self.caller.check_calls(task)
        entry.output = output
        return output, records

    def _referenced(self, source: int, value: Any, entry: Served) -> Any:
        """An argument as the owner has it: a referenced output joins the caller's chain."""
        if not isinstance(value, OutputRef):
            return value
        other = self._finished_entry((source, value.call_id))
        self._join(entry, other)
        return resolve_output(other.output, value.path, other.module)

    def _join(self, entry: Served, other: Served) -> None:
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

    def _served_entry(self, key: CallKey, what: str) -> Served:
        with self._served_lock:
            entry = self._served.get(key)
        if entry is None:
            raise ModelParallelError(
                f"rank {self.group.rank}: {what} from rank {key[0]} is no longer kept (its "
                "microbatch ended, or it ran without grad and backward came anyway)"
            )
        return entry

    def _finished_entry(self, key: CallKey) -> Served:
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

        Where the policy splits it (the step's last microbatches, whose weight halves fill the
        drain), only the inputs' gradients are computed before the reply (the task's period
        is an ``I``); the weights' wait as a ``W`` task of their own for idle time, and the
        step does not end on this rank before they have run (:mod:`.executor`). A request
        marked ``last`` is the microbatch's last backward here: the rank's backward action of
        it is over once it has run (in a plan's order, the next action may begin while the
        reply is sent).
        """
        task = self.executor.current()
        assert task is not None
        try:
            # Before computing: a value fetched with its backward may still be computing.
            entry = self._finished_entry((message.source, message.body["call"]))
            mode = ComputeMode.from_wire(message.extra["mode"])
            with self.executor.computing(message.module), mode.applied():
                body, grads, weights = self._compute_backward(message, tensors, entry)
                task.phase = "B" if weights is None else "I"  # what this period is recorded as
        except BaseException as exc:
            self._send_error(message, exc)
            return
        if weights is not None:
            weights_task = Task("serve", message.microbatch, "W", message.module, message.step)
            self.executor.owe_weights(weights_task)
        if message.body.get("last"):  # before the reply: the next action computes meanwhile
            self.executor.notices.backward_over(message.step, message.microbatch)
        self._send_reply(message, Message(REPLY, message.call_id, body=body), grads)
        if weights is not None:
            run = functools.partial(self._run_weights, weights, mode)
            self.executor.run_weights(weights_task, run, self._weights_failed)

    def _run_weights(self, weights: WeightHalf, mode: ComputeMode) -> None:
        """The weight half of a split backward, letting more urgent work go first between its
        autograd calls."""
        with mode.applied():
            weights.run(between=self.executor.give_way)

    def _weights_failed(self, exc: BaseException) -> None:
        """A weight half failed (computing, or waiting for its turn): this rank's step fails."""
        self._weights_failure = error_body(self.group.rank, exc)

    def _own_parameters(self) -> Iterator[nn.Parameter]:
        for name, module in self._modules.items():
            if self.owners[name] == self.group.pp_rank:
                yield from module.parameters(recurse=False)

    def _compute_backward(
        self, message: Message, tensors: list[torch.Tensor], entry: Served
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
        split = self.policy.splits_backward(self.group.pp_rank, message.microbatch)
        if pairs and wanted and not keep_graph and split:
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

    def _forget_chain(self, chain: Chain) -> None:
        """Drop a chain after its backward; a member still computing (joined the chain, its
        outputs unused) stays until it finishes, so a confirmation of it can wait for it."""
        with self._served_lock:
            for key in chain.members:
                entry = self._served.get(key)
                if entry is not None and entry.done.is_set():
                    del self._served[key]

    def forget_microbatch(self, step: int, microbatch: int) -> None:
        """The leader finished this microbatch: nothing of it is needed any more."""
        with self._served_lock:
            for key in [
                k for k, v in self._served.items() if (v.step, v.microbatch) == (step, microbatch)
            ]:
                del self._served[key]

    def forget_served(self, step: int | None) -> None:
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

    def raise_weights_failure(self) -> None:
        failure, self._weights_failure = self._weights_failure, None
        if failure is not None:
            raise failure

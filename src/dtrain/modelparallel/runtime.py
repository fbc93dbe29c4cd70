"""One rank's side of a pipeline: serving the modules it owns, calling the others', running steps.

The leader (pp rank 0) runs the step body once per microbatch, each in its own task; calls to
modules owned elsewhere become requests to their owners (:mod:`dtrain.modelparallel.remote`).
Every rank serves the requests it receives in tasks of its own, so a module can call back into the
caller's rank, and several microbatches are in flight on all partitions at once. The executor's
compute token decides which task computes next (the pipeline schedule's policy). When the
leader's microbatches are done it sends their results to the other ranks of the pipeline, which
return them from the step too.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from dtrain.modelparallel.executor import Executor, Outcome, Task, effective_policy
from dtrain.modelparallel.remote import CallRecord, call_remote, install_stub, remove_stub
from dtrain.modelparallel.transport import (
    BACKWARD,
    END_STEP,
    ERROR,
    FORWARD,
    REPLY,
    Message,
    Transport,
    error_body,
    flatten,
    unflatten,
)

_POLL_S = 0.5

GIL_SWITCH_INTERVAL_S = 0.0005
"""Python hands the GIL to a waiting thread after this long (default 5 ms). A rank's receiver
and its tasks take turns at every message, and each turn costing up to 5 ms would stall the
whole pipeline behind whichever thread runs Python code."""


@dataclass
class _Served:
    """What the owner keeps of a forward call it served, until the call's backward."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    arrival: int
    """Receive order of the request: tells which step it belongs to (see ``_forget_served``)."""


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
        pipeline: str,
        microbatches: int,
        active_microbatches: int,
    ) -> None:
        self.group = group
        self.owners = owners
        self._modules = modules
        policy = effective_policy(pipeline, microbatches, active_microbatches)
        self.executor = Executor(group.pp_rank, policy, active_microbatches, group.timeout)
        self._served: dict[tuple[int, int], _Served] = {}
        self._served_lock = threading.Lock()
        self._inbox: queue.Queue[tuple[Message, list[torch.Tensor], int]] = queue.Queue()
        self._arrivals = 0
        self._steps = 0
        self.transport: Transport | None = None
        if len(group.ranks) > 1:
            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
            assert group.control_group is not None and group.data_group is not None
            self.transport = Transport(
                group.rank,
                group.ranks,
                group.control_group,
                group.data_group,
                group.device,
                group.timeout,
                self._on_message,
            )
        for name, module in modules.items():
            if owners[name] != group.pp_rank:
                install_stub(module, self._stub(name))
            elif name:
                install_stub(module, self._guard(name, module.forward))

    @property
    def is_leader(self) -> bool:
        return self.group.pp_rank == 0

    # --- calling modules on other ranks ------------------------------------------------------

    def _stub(self, name: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.executor.current() is None:
                raise NotInStepError(
                    f"module {name or '<root>'!r} was called outside an @smp.step function: "
                    "call the model (and model.backward) inside the step function"
                )
            return call_remote(self, name, self.owners[name], args, kwargs)

        return forward

    def _guard(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        """An owned module computes with the token; when called from code that holds it
        already (its parent's forward) this costs nothing (see :mod:`.executor`)."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            with self.executor.computing_module(name):
                return forward(*args, **kwargs)

        return guarded

    def _exchange(
        self, owner: int, message: Message, tensors: list[torch.Tensor]
    ) -> tuple[Message, list[torch.Tensor]]:
        """Send a request to partition ``owner``; give the token away until the reply."""
        assert self.transport is not None
        task = self.executor.current()
        message.microbatch = task.microbatch if task is not None else 0
        with self.executor.waiting():
            pending = self.transport.request(self.group.ranks[owner], message, tensors)
            return pending.wait(self.group.timeout, self.group.rank)

    def forward_call(
        self, record: CallRecord, structure: Any, tensors: list[torch.Tensor], grad: bool
    ) -> None:
        """Run a remote module's forward; fills the record with the owner's outputs."""
        assert self.transport is not None
        record.call_id = self.transport.next_call_id()
        message = Message(
            FORWARD, record.call_id, module=record.module, body=structure, extra={"grad": grad}
        )
        reply, outputs = self._exchange(record.owner, message, tensors)
        record.output_structure = reply.body
        record.outputs = outputs
        record.output_meta = reply.meta

    def backward_call(
        self, record: CallRecord, grads: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Send a remote call's output gradients to its owner; the gradients of its inputs."""
        assert self.transport is not None
        message = Message(
            BACKWARD,
            self.transport.next_call_id(),
            module=record.module,
            body={"call": record.call_id, "present": [g is not None for g in grads]},
        )
        reply, tensors = self._exchange(record.owner, message, [g for g in grads if g is not None])
        received = iter(tensors)
        return [next(received) if present else None for present in reply.body["present"]]

    # --- serving calls from other ranks ------------------------------------------------------

    def _on_message(self, message: Message, tensors: list[torch.Tensor]) -> None:
        """Receiver thread: requests become tasks; step ends and failures go to the inbox."""
        self._arrivals += 1
        arrival = self._arrivals
        if message.kind in (FORWARD, BACKWARD):
            self.executor.spawn(lambda: self._serve(message, tensors, arrival))
        else:
            if not self.is_leader:
                self.executor.reclaim_main()
            self._inbox.put((message, tensors, arrival))

    def _serve(self, message: Message, tensors: list[torch.Tensor], arrival: int) -> None:
        assert self.transport is not None
        phase = "F" if message.kind == FORWARD else "B"
        task = Task("serve", message.microbatch, phase, message.module)
        outputs: list[torch.Tensor] = []
        try:
            with self.executor.computing(task):
                if message.kind == FORWARD:
                    body, outputs = self._serve_forward(message, tensors, arrival)
                else:
                    body, outputs = self._serve_backward(message, tensors)
            reply = Message(REPLY, message.call_id, body=body)
        except BaseException as exc:
            reply = Message(ERROR, message.call_id, body=error_body(self.group.rank, exc))
            outputs = []
        with contextlib.suppress(ModelParallelError):  # broken pipeline: the caller's wait says so
            self.transport.send(message.source, reply, outputs)

    def _serve_forward(
        self, message: Message, tensors: list[torch.Tensor], arrival: int
    ) -> tuple[Any, list[torch.Tensor]]:
        grad = bool(message.extra.get("grad"))
        inputs = [
            t.requires_grad_() if meta.requires_grad and grad else t
            for t, meta in zip(tensors, message.meta, strict=True)
        ]
        args, kwargs = unflatten(message.body, inputs)
        with torch.set_grad_enabled(grad):
            output = self._modules[message.module](*args, **kwargs)
        structure, outputs = flatten(output)
        if grad and any(t.requires_grad for t in outputs):
            with self._served_lock:
                key = (message.source, message.call_id)
                self._served[key] = _Served(inputs, outputs, arrival)
        return structure, outputs

    def _serve_backward(
        self, message: Message, tensors: list[torch.Tensor]
    ) -> tuple[Any, list[torch.Tensor]]:
        key = (message.source, message.body["call"])
        with self._served_lock:
            served = self._served.pop(key, None)
        if served is None:
            raise ModelParallelError(
                f"backward for call #{key[1]} of module {message.module!r} from rank {key[0]}: "
                "its forward was not kept (ran without grad, or backward ran twice)"
            )
        received = iter(tensors)
        grads = [next(received) if present else None for present in message.body["present"]]
        pairs = [
            (out, g)
            for out, g in zip(served.outputs, grads, strict=True)
            if g is not None and out.requires_grad
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [g for _, g in pairs])
        input_grads = [t.grad if t.requires_grad else None for t in served.inputs]
        present = [g is not None for g in input_grads]
        return {"present": present}, [g for g in input_grads if g is not None]

    # --- steps -------------------------------------------------------------------------------

    def run_step(self, count: int, body: Callable[[int], Any] | None) -> list[Outcome]:
        """Every rank of the pipeline: the leader runs ``body`` per microbatch, others serve.

        Returns each microbatch's outcome on every rank; a failure on the leader comes back as
        ``(False, error)`` on all ranks.
        """
        self._steps += 1
        self.executor.clear_timeline()
        if self.is_leader:
            assert body is not None
            try:
                outcomes = self.executor.run_microbatches(count, body)
            finally:
                self._forget_served(None)
            self._announce(outcomes)
            return outcomes
        outcomes, arrival = self._await_step_end()
        self._forget_served(arrival)
        return outcomes

    def _forget_served(self, before: int | None) -> None:
        """Drop kept forwards whose backward never came (evaluation, unused outputs).

        On the leader nothing else is running once its microbatches are done. Another rank may
        already serve the leader's next step when it gets the end of this one, so it drops only
        the requests that arrived before that end (the leader sends them in order).
        """
        with self._served_lock:
            if before is None:
                self._served.clear()
            else:
                for key in [k for k, v in self._served.items() if v.arrival < before]:
                    del self._served[key]

    def abort_step(self, error: BaseException) -> None:
        """The leader could not start the step: release the other ranks with the error."""
        self._steps += 1
        self._announce([(False, error)])

    def _announce(self, outcomes: list[Outcome]) -> None:
        if self.transport is None:
            return
        payload = [
            (ok, value if ok else error_body(self.group.rank, value)) for ok, value in outcomes
        ]
        structure, tensors = flatten(payload)
        tensors = [t.detach() for t in tensors]
        for peer in self.transport.peers:
            self.transport.send(peer, Message(END_STEP, self._steps, body=structure), tensors)

    def _await_step_end(self) -> tuple[list[Outcome], int]:
        assert self.transport is not None
        leader = self.group.ranks[0]
        executor = self.executor
        executor.lend_main()
        try:
            while True:
                try:
                    message, tensors, arrival = self._inbox.get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    idle = time.monotonic() - max(
                        self.transport.last_activity, executor.last_progress
                    )
                    if idle > self.group.timeout:
                        raise CommunicationTimeoutError(
                            f"rank {self.group.rank}: nothing from the pipeline for "
                            f"{self.group.timeout:g} s while waiting for the leader (rank "
                            f"{leader}) to end step {self._steps}"
                        ) from None
        finally:
            executor.reclaim_main()
            executor.resume_main()
        if message.kind != END_STEP:
            raise ModelParallelError(f"rank {self.group.rank}: pipeline failed: {message.body}")
        outcomes: list[Outcome] = []
        for ok, value in unflatten(message.body, tensors):
            if not ok and isinstance(value, RemoteError) and not isinstance(value, StepFailedError):
                value = StepFailedError(
                    value.rank, value.exc_type, value.message, value.remote_traceback
                )
            outcomes.append((ok, value))
        return outcomes, arrival

    # --- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving (every rank of the pipeline calls this) and restore the modules."""
        if self.transport is not None:
            self.transport.close()
        for module in self._modules.values():
            remove_stub(module)

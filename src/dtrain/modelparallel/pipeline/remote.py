"""Calling a module that lives on another rank, with autograd flowing back through the call.

On a rank that does not own a module, the module's ``forward`` is replaced by a stub that sends
the call (arguments of any nesting, tensors and picklable values, keyword arguments included) to
the owner. The owner keeps what it computed; the caller gets either the outputs themselves or
*deferred* outputs:

* **Eager** (the first call of a module with given argument kinds): the caller waits for the
  owner's reply, which carries the outputs; they become the outputs of one autograd node
  (:class:`RemoteFetch`) whose backward sends their gradients to the owner.
* **Deferred** (later calls): the outputs will have the structure the previous call's had, so
  the stub returns at once with a :class:`RemoteValue` at each tensor of that structure, and the
  owner replies only if the call fails. A deferred value passed to another module of the same
  owner travels as a reference (:class:`~..transport.message.OutputRef`): the owner
  uses its own tensor, and the calls chain on the owner, in its autograd graph, without a round
  trip through the caller. Anything else the caller does with it (an operator, a torch function,
  an attribute, another rank's module, a module of its own) fetches it first, again through a
  :class:`RemoteFetch`. The owner checks the structure it computed against the prediction sent
  with the call: a module whose output structure changes between calls with the same kinds of
  arguments fails the step with an error that says so. A call is known to have succeeded once its
  value (or one computed from it) was fetched; a call nobody fetched from is confirmed with a
  round trip when its microbatch ends.

A fetched value's backward runs on the owner from that value down to every input the caller sent
into its chain of calls (the fetched call, the calls it referenced, and so on), and returns their
gradients: a chain of k calls costs one backward round trip, not k.

An empty *anchor* tensor that requires grad is passed along with the real inputs, so the outputs
require grad even when no input does (integer token ids into an embedding on another rank): the
owner's parameters must still get their gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules.unfetched import Unfetched, materialize
from dtrain.modelparallel.transport.message import (
    Message,
    OutputRef,
    Pending,
    TensorMeta,
    TensorRef,
)
from dtrain.modelparallel.transport.structure import map_leaves, map_with_path, resolve, unflatten

LeafId = tuple[int, int]
"""An input the caller sent: (call id, index among that call's tensors)."""


class Caller(Protocol):
    """What a remote call's caller-side state needs from the rank that made the call."""

    def wait(self, pending: Pending, reply: bool = False) -> tuple[Message, list[torch.Tensor]]:
        """The reply, giving the compute token away meanwhile (``reply``: a call's, awaited
        only to learn its outputs' structure)."""
        ...

    def confirm(self, record: CallRecord) -> None:
        """Wait until the owner has finished a deferred call (its error raises)."""
        ...

    def fetch(self, record: CallRecord, path: tuple[Any, ...]) -> Any:
        """The value at ``path`` of a deferred call's outputs."""
        ...

    def backward_call(
        self,
        record: CallRecord,
        path: tuple[Any, ...],
        leaves: list[LeafId],
        grads: list[torch.Tensor | None],
    ) -> list[torch.Tensor | None]:
        """Backward from a fetched value on its owner; the gradients of the sent ``leaves``."""
        ...

    def forget(self, record: CallRecord) -> None:
        """No reply to the call will be waited for."""
        ...


@dataclass(eq=False)
class CallRecord:
    """Caller-side state of one remote call, shared by its outputs, fetches and backward."""

    runtime: Caller
    module: str
    owner: int
    call_id: int
    grad: bool
    sent: list[torch.Tensor]
    refs: list[CallRecord]
    pending: Pending
    predicted: Any = None
    """The structure the outputs are assumed to have (deferred calls; the owner checks it)."""
    structure: Any = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    meta: tuple[TensorMeta, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    """The reply's extras (an eager call's hook records, see :mod:`.hooks`)."""
    _settled: bool = False

    def reply(self, learning: bool = False) -> Any:
        """Wait until the call is known to have succeeded (its error raises); its structure
        (``learning``: awaited only for that, see
        :meth:`~..scheduling.ordering.PlannedOrdering.visit_over`)."""
        if not self._settled:
            if self.predicted is None:
                message, tensors = self.runtime.wait(self.pending, reply=learning)
                self.structure, self.outputs, self.meta = message.body, tensors, message.meta
                self.extra = message.extra
                self._settled = True
            else:
                self.runtime.confirm(self)
        return self.structure

    def succeeded(self) -> None:
        """A value of this call, or of one that referenced it, was fetched: the call and every
        call it referenced succeeded, so no error reply can come for them any more."""
        stack = [self]
        while stack:
            record = stack.pop()
            if not record._settled:
                record._settled = True
                record.structure = record.predicted
                record.runtime.forget(record)
                stack.extend(record.refs)

    def failure(self) -> BaseException | None:
        """The call's own error, if the owner has reported one: more telling than the error of
        a later request that used its outputs."""
        return self.pending.failure()

    def closure(self) -> tuple[list[LeafId], list[torch.Tensor]]:
        """The differentiable inputs sent into this call's chain, and where the owner has them."""
        ids: list[LeafId] = []
        tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        stack = [self]
        while stack:
            record = stack.pop()
            if record.call_id in seen:
                continue
            seen.add(record.call_id)
            for index, tensor in enumerate(record.sent):
                if tensor.requires_grad and tensor.is_floating_point():
                    ids.append((record.call_id, index))
                    tensors.append(tensor)
            stack.extend(record.refs)
        return ids, tensors


@dataclass
class _FetchContext:
    """What the backward of fetched outputs needs; not the outputs themselves (see
    :class:`RemoteFetch`)."""

    record: CallRecord
    path: tuple[Any, ...]
    leaves: list[LeafId]


class RemoteFetch(torch.autograd.Function):
    """Autograd node of a fetched remote value: its backward runs on the owner.

    The outputs come in a list, not as tensor arguments (they are this node's outputs, not its
    inputs), and nothing the node keeps refers to them: an output's ``grad_fn`` is this node,
    and a reference back from its context would make a cycle through autograd's nodes, which
    Python's collector does not see, keeping the outputs alive after the step."""

    @staticmethod
    def forward(
        ctx: Any,
        fetch: _FetchContext,
        outputs: list[tuple[torch.Tensor, TensorMeta]],
        anchor: torch.Tensor,
        *inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        del anchor, inputs  # the owner computed the outputs; these put the chain on the graph
        ctx.fetch = fetch
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[t for t, meta in outputs if not meta.requires_grad])
        ctx.input_count = len(fetch.leaves)
        return tuple(t for t, _ in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        fetch: _FetchContext = ctx.fetch
        if all(g is None for g in grads):
            return (None, None, None) + (None,) * ctx.input_count
        input_grads = fetch.record.runtime.backward_call(
            fetch.record, fetch.path, fetch.leaves, list(grads)
        )
        return (None, None, None, *input_grads)


def attach(
    record: CallRecord,
    path: tuple[Any, ...],
    structure: Any,
    tensors: list[torch.Tensor],
    meta: tuple[TensorMeta, ...],
) -> Any:
    """The owner's outputs at ``path`` as the caller's values, on the caller's autograd graph."""
    outputs: tuple[torch.Tensor, ...] | list[torch.Tensor] = tensors
    if record.grad and any(m.requires_grad for m in meta):
        leaves, inputs = record.closure()
        context = _FetchContext(record, path, leaves)
        pairs = list(zip(tensors, meta, strict=True))
        with torch.enable_grad():  # fetched under no_grad, still differentiable later
            anchor = torch.empty(0, requires_grad=True)
            outputs = RemoteFetch.apply(context, pairs, anchor, *inputs)
    return unflatten(structure, list(outputs))


class RemoteValue(Unfetched):
    """A tensor a remote call will produce, not fetched yet (see the module docstring).

    Passed to a module of its owner it stays there; any other use fetches it, once, after which
    it stands for the fetched tensor (so in-place changes are seen by later calls).
    """

    __slots__ = ("_fetched", "_path", "_record")

    def __init__(self, record: CallRecord, path: tuple[Any, ...]) -> None:
        self._record = record
        self._path = path
        self._fetched: torch.Tensor | None = None

    def reference_for(self, owner: int) -> OutputRef | None:
        """How to pass this value to a module of ``owner``: a reference, if it is still there."""
        if self._fetched is None and self._record.owner == owner:
            return OutputRef(self._record.call_id, self._path)
        return None

    @property
    def record(self) -> CallRecord:
        return self._record

    @property
    def path(self) -> tuple[Any, ...]:
        return self._path

    @property
    def fetched(self) -> bool:
        return self._fetched is not None

    def resolve(self, value: torch.Tensor) -> None:
        """The value arrived another way (with its backward): later uses need no fetch."""
        self._fetched = value

    def fetch(self) -> torch.Tensor:
        if self._fetched is None:
            self._fetched = self._record.runtime.fetch(self._record, self._path)
        return self._fetched

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args, kwargs = materialize((args, kwargs or {}))
        return func(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fetch(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in RemoteValue.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.fetch(), name, value)

    def __repr__(self) -> str:
        return repr(self.fetch())

    __hash__ = object.__hash__


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: RemoteValue, *args: Any) -> Any:
        return getattr(self.fetch(), name)(*materialize(args))

    method.__name__ = name
    return method


_FETCHING_METHODS = (
    "__add__",
    "__radd__",
    "__iadd__",
    "__sub__",
    "__rsub__",
    "__isub__",
    "__mul__",
    "__rmul__",
    "__imul__",
    "__truediv__",
    "__rtruediv__",
    "__itruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__rmod__",
    "__pow__",
    "__rpow__",
    "__matmul__",
    "__rmatmul__",
    "__and__",
    "__rand__",
    "__or__",
    "__ror__",
    "__xor__",
    "__rxor__",
    "__lshift__",
    "__rshift__",
    "__neg__",
    "__pos__",
    "__abs__",
    "__invert__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__eq__",
    "__ne__",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "__len__",
    "__iter__",
    "__reversed__",
    "__contains__",
    "__getitem__",
    "__setitem__",
    "__delitem__",
    "__format__",
    "__array__",
    "__dlpack__",
    "__dlpack_device__",
)
"""Operators and protocols of a tensor: using any of them on a :class:`RemoteValue` fetches it."""

for _name in _FETCHING_METHODS:
    setattr(RemoteValue, _name, _delegate(_name))


def deferred_outputs(record: CallRecord, structure: Any) -> Any:
    """The outputs of a deferred call: ``structure`` with a :class:`RemoteValue` per tensor."""

    return map_with_path(
        structure,
        lambda node, path: RemoteValue(record, path) if isinstance(node, TensorRef) else node,
    )


def predictable(structure: Any) -> bool:
    """Whether outputs of this structure can be assumed before they exist: only containers,
    tensors and ``None`` (any other value may change from call to call)."""
    leaves: list[Any] = []
    map_leaves(structure, leaves.append)
    return all(leaf is None or isinstance(leaf, TensorRef) for leaf in leaves)


def same_structure(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_structure(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_structure(a[k], b[k]) for k in a)
    return bool(a == b)


def check_prediction(module: str, structure: Any, predicted: Any) -> None:
    """The owner's check of a deferred call: it returned the structure the caller assumed."""
    if not same_structure(structure, predicted):
        raise ModelParallelError(
            f"module {module!r} returned {_shape_text(structure)} where its previous call with "
            f"the same kinds of arguments returned {_shape_text(predicted)}: dtrain pipelines "
            "calls by assuming the structure repeats for the same module and non-tensor "
            "arguments: return the same structure every time, or pass what decides it as a "
            "non-tensor argument"
        )


def call_signature(module: str, structure: Any) -> str:
    """What the output structure of a call is assumed to depend on: the module and the
    arguments, with every tensor (sent or referenced) as ``T``."""
    kinds = map_leaves(structure, lambda v: "T" if isinstance(v, (TensorRef, OutputRef)) else v)
    return f"{module}:{kinds!r}"


class _Shown:
    """Prints as its text, unquoted: ``(tensor, None)`` in messages."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shape_text(structure: Any) -> str:
    tensor = _Shown("tensor")
    return repr(map_leaves(structure, lambda v: tensor if isinstance(v, TensorRef) else v))


def resolve_output(output: Any, path: tuple[Any, ...], module: str) -> Any:
    try:
        return resolve(output, path)
    except (KeyError, IndexError, TypeError) as exc:
        raise ModelParallelError(
            f"output {path!r} of module {module!r} does not exist in what it returned"
        ) from exc

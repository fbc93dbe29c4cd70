"""Per-module profile of one training step of a whole model, the input of the partitioner.

:func:`profile_module` runs the full model in this process, the way SMP v1 traces it at the first
``smp.step``, and records for every module of ``named_modules()`` (by qualified name, ``""`` is the
root):

* calls, and the index of its first call in execution order;
* forward time, inclusive and exclusive (minus the time inside the modules it calls);
* backward time, inclusive and exclusive (see below);
* parameter and buffer bytes it owns directly (``recurse=False``), a shared parameter counted
  once, at its first owner, and the **tied groups**: sets of modules that share a parameter, which
  must share a partition (:func:`static_profile` has these facts without running the model);
* activation bytes: the output tensors it created (a child's output passed on is counted once, at
  the child);
* every **call**: its caller and the bytes of its tensor arguments and outputs. In the
  module-server runtime a call to a module on another partition sends exactly its arguments to the
  owner and its outputs back to the caller (and the same sizes again as gradients in backward), so
  these are the bytes a partition plan makes cross between ranks. A tensor the caller keeps in its
  own code (a skip connection summed in the parent) never moves.

How it is measured, and why:

* One untimed **structure pass** records the calls and sizes; it doubles as the warm-up.
* ``repeats`` **timed passes** use hooks that only read the clock (and synchronise the device on
  CUDA, so per-module times are real). Hook bookkeeping is measured and subtracted. A module called
  twice has its calls summed; each time is the median over the passes, so one pass slowed by a
  busy machine does not skew the plan.
* **Backward** time is measured per autograd node: every node of the graph gets a pre- and a
  post-hook, and a node belongs to the call whose forward created it (autograd sequence numbers
  mark each call's window). A module's exclusive backward is the time of the nodes its own code
  created, plus gradient accumulation into its own parameters; inclusive adds the calls it made.
  Nodes created outside every call (the loss) are reported as ``unattributed_backward_time``.
  Engine overhead between nodes is not attributed, so the per-module sum is below the wall time.

The model is left as it was: gradients (of the parameters and of input tensors), buffers (e.g.
BatchNorm statistics) and the RNG state are restored, and every pass starts from the same RNG
state, so dropout and data-dependent branches take the same path in every pass.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from dtrain.modelparallel.deferred import META, is_factory, meta_twins, swap_in

FORMAT_VERSION = 1

DEFAULT_REPEATS = 3
"""Timed passes when not told otherwise: the job's profile and ``dtrain plan``'s both take the
median of three, so they agree."""


@dataclass
class ModuleStats:
    """What one module cost in the profiled step. Times are seconds, sizes bytes."""

    name: str
    type: str
    parent: str | None
    children: list[str] = field(default_factory=list)
    calls: int = 0
    order: int | None = None
    """Index (into :attr:`ModelProfile.calls`) of the first call; ``None`` if it never ran."""
    forward_time: float = 0.0
    forward_exclusive: float = 0.0
    backward_time: float = 0.0
    backward_exclusive: float = 0.0
    param_bytes: int = 0
    param_count: int = 0
    buffer_bytes: int = 0
    activation_bytes: int = 0
    """Bytes of the output tensors it created, summed over calls."""
    flops: int = 0
    """Floating-point operations of its own forward code (its submodules' excluded), summed
    over calls, as torch's ``FlopCounterMode`` counts them (matrix products, convolutions,
    attention): exact, so plans can tell apart what timing noise cannot."""
    tied_group: int | None = None
    """Index into :attr:`ModelProfile.tied_groups` when it shares a parameter with others."""


@dataclass
class ProfiledCall:
    """One forward call of a module, in execution (start) order."""

    index: int
    module: str
    caller: int
    """The call whose code made this call; ``-1`` when called from outside the model."""
    input_bytes: int = 0
    """Bytes of the distinct tensors among its arguments (positional and keyword)."""
    output_bytes: int = 0
    """Bytes of the distinct tensors in its outputs."""


@dataclass
class ModelProfile:
    """Result of :func:`profile_module`: plain data that round-trips through JSON."""

    modules: dict[str, ModuleStats]
    calls: list[ProfiledCall] = field(default_factory=list)
    tied_groups: list[list[str]] = field(default_factory=list)
    repeats: int = 0
    """Timed passes behind the times; 0 for a :func:`static_profile`."""
    device: str = "cpu"
    forward_time: float = 0.0
    """Wall time of the model's forward (median over the timed passes)."""
    backward_time: float = 0.0
    """Wall time of the backward (median over the timed passes; 0 when there was none)."""
    backward_measured: bool = False
    """A backward ran while profiling (its times are measured unless ``repeats`` is 0)."""
    unattributed_backward_time: float = 0.0

    @property
    def root(self) -> ModuleStats:
        return self.modules[""]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["modules"] = list(data["modules"].values())
        data["format"] = FORMAT_VERSION
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelProfile:
        data = dict(data)
        version = data.pop("format", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"profile format {version} is not supported (want {FORMAT_VERSION})")
        modules = {m["name"]: ModuleStats(**m) for m in data.pop("modules")}
        calls = [ProfiledCall(**c) for c in data.pop("calls")]
        return cls(modules=modules, calls=calls, **data)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelProfile:
        return cls.from_dict(json.loads(text))


def static_profile(module: nn.Module) -> ModelProfile:
    """The facts known without running the model: tree, parameter bytes, tied groups."""
    named = list(module.named_modules())
    present = {name for name, _ in named}
    stats: dict[str, ModuleStats] = {}
    owners = _parameter_owners(named)
    seen_buffers: set[int] = set()
    for name, mod in named:
        parent = parent_name(name, present)
        entry = ModuleStats(name=name, type=type(mod).__qualname__, parent=parent)
        if parent is not None:
            stats[parent].children.append(name)
        for param in mod.parameters(recurse=False):
            if owners[id(param)] == name:
                entry.param_bytes += _nbytes(param)
                entry.param_count += param.numel()
        for buffer in mod.buffers(recurse=False):
            if id(buffer) not in seen_buffers:
                seen_buffers.add(id(buffer))
                entry.buffer_bytes += _nbytes(buffer)
        stats[name] = entry
    groups = _tied_groups(named)
    for index, group in enumerate(groups):
        for name in group:
            stats[name].tied_group = index
    device = next((str(t.device) for t in _module_tensors(module)), "cpu")
    return ModelProfile(modules=stats, tied_groups=groups, device=device)


def profile_module(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    repeats: int = DEFAULT_REPEATS,
    loss_fn: Callable[[Any], Tensor] | None = None,
    backward: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
) -> ModelProfile:
    """Profile ``module(*args, **kwargs)`` and a backward pass, per module.

    ``progress(done, total, what)`` is told before each pass (``total`` is ``repeats + 1``)
    and once all are done, for a caller that shows how far a long profile is.

    The backward starts from ``loss_fn(outputs)`` if given, else from the sum of every floating
    tensor in the outputs that requires grad (the gradient values do not matter for timing). With
    ``backward=False`` or nothing to differentiate, backward times stay 0. With ``repeats=0``
    only the structure pass runs: calls, sizes and operation counts, no times; that pass also
    runs on a model and arguments on the ``meta`` device, which hold no memory.
    """
    if repeats < 0:
        raise ValueError(f"repeats must be at least 0, got {repeats}")
    kwargs = dict(kwargs or {})
    profile = static_profile(module)
    profile.repeats = repeats
    inputs = _unique_tensors((args, kwargs))
    devices = {t.device for t in [*_module_tensors(module), *inputs]}
    cuda = any(device.type == "cuda" for device in devices)
    owners = _parameter_owners(list(module.named_modules()))
    recorder = _Recorder(profile, owners, synchronizer(devices))
    snapshot = Snapshot(module, [t for t in inputs if t.is_leaf and t.requires_grad], cuda)
    handles = []
    for name, mod in module.named_modules():
        handles.append(
            mod.register_forward_pre_hook(partial(recorder.pre_hook, name), with_kwargs=True)
        )
        handles.append(
            mod.register_forward_hook(
                partial(recorder.post_hook, name), with_kwargs=True, always_call=True
            )
        )
    passes: list[_Pass] = []
    report = progress or (lambda done, total, what: None)
    try:
        with torch.enable_grad():
            # Structure pass: calls, sizes and operations; also the warm-up.
            report(0, repeats + 1, "structure pass")
            snapshot.reset()
            recorder.start_structure(inputs)
            with FlopCounterMode(display=False) as counter:
                outputs = module(*args, **kwargs)
            _record_flops(profile, counter.get_flop_counts(), type(module).__name__)
            recorder.mode = _OFF
            loss = _loss(outputs, loss_fn) if backward else None
            if loss is not None:
                loss.backward()
                profile.backward_measured = True
            del outputs, loss
            recorder.end_structure()

            for index in range(repeats):
                report(index + 1, repeats + 1, f"timed pass {index + 1} of {repeats}")
                snapshot.reset()
                recorder.start_timed()
                recorder.sync()
                start = time.perf_counter()
                outputs = module(*args, **kwargs)
                recorder.sync()
                forward = time.perf_counter() - start
                recorder.mode = _OFF
                loss = _loss(outputs, loss_fn) if backward else None
                timing = recorder.timed_backward(loss) if loss is not None else None
                del outputs, loss
                passes.append(recorder.end_timed(forward, timing))
            report(repeats + 1, repeats + 1, "profiled")
    finally:
        recorder.mode = _OFF
        for handle in handles:
            handle.remove()
        snapshot.restore()
    if passes:
        _fold(profile, passes)
    return profile


def _record_flops(
    profile: ModelProfile, counts: Mapping[str, Mapping[Any, int]], root: str
) -> None:
    """Each module's own forward operations, from ``FlopCounterMode``'s counts per module path
    (``Root.sub.module``, each including its submodules'; a container that is never called, a
    ``ModuleList``, has none: its children's are its own)."""
    inclusive: dict[str, int] = {}

    def count(name: str) -> int:
        below = sum(count(child) for child in profile.modules[name].children)
        path = f"{root}.{name}" if name else root
        inclusive[name] = sum(counts[path].values()) if path in counts else below
        profile.modules[name].flops = max(0, inclusive[name] - below)
        return inclusive[name]

    count("")


# --------------------------------------------------------------------------------------------
# Static facts


def parent_name(name: str, present: set[str]) -> str | None:
    """Nearest registered ancestor (a deduplicated container may be missing from the listing)."""
    if name == "":
        return None
    while name:
        name = name.rpartition(".")[0]
        if name in present:
            return name
    return ""


def within(name: str, ancestor: str) -> bool:
    """``name`` is ``ancestor`` or in its subtree."""
    return not ancestor or name == ancestor or name.startswith(ancestor + ".")


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _parameter_owners(named: list[tuple[str, nn.Module]]) -> dict[int, str]:
    """``id(parameter) -> name`` of the first module holding it: a shared one counts there."""
    owners: dict[int, str] = {}
    for name, mod in named:
        for param in mod.parameters(recurse=False):
            owners.setdefault(id(param), name)
    return owners


def _tied_groups(named: list[tuple[str, nn.Module]]) -> list[list[str]]:
    """Connected sets of modules sharing any parameter, in module order."""
    users: dict[int, list[str]] = {}
    for name, mod in named:
        for param in mod.parameters(recurse=False):
            users.setdefault(id(param), []).append(name)
    root: dict[str, str] = {}

    def find(name: str) -> str:
        while root.setdefault(name, name) != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    for names in users.values():
        for other in names[1:]:
            root[find(other)] = find(names[0])
    members: dict[str, list[str]] = {}
    for name, _ in named:
        if name in root:
            members.setdefault(find(name), []).append(name)
    return [group for group in members.values() if len(group) > 1]


def _module_tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _tensors(obj: Any, _depth: int = 0) -> Iterator[Tensor]:
    """Tensors nested in tuples, lists, sets, mappings and dataclasses (outputs, arguments)."""
    if isinstance(obj, Tensor):
        yield obj
    elif _depth > 32 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value, _depth + 1)
    elif isinstance(obj, (tuple, list, set, frozenset)):
        for value in obj:
            yield from _tensors(value, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name, None), _depth + 1)


def _unique_tensors(obj: Any) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for t in _tensors(obj):
        seen.setdefault(id(t), t)
    return list(seen.values())


def _loss(outputs: Any, loss_fn: Callable[[Any], Tensor] | None) -> Tensor | None:
    """Scalar to run backward from, or ``None`` when nothing requires grad."""
    if loss_fn is not None:
        loss = loss_fn(outputs)
        return loss if loss.requires_grad else None
    total: Tensor | None = None
    for t in _unique_tensors(outputs):
        if t.requires_grad and (t.is_floating_point() or t.is_complex()):
            part = t.sum().real.float()
            total = part if total is None else total + part
    return total


def synchronizer(devices: Iterable[torch.device]) -> Callable[[], None]:
    """What waits for the work queued on the GPUs among ``devices``, each named:
    ``torch.cuda.synchronize()`` waits for the current device only, which need not be the
    module's. Nothing to wait for on the CPU."""
    gpus = sorted({device for device in devices if device.type == "cuda"}, key=str)

    def sync() -> None:
        for gpu in gpus:
            torch.cuda.synchronize(gpu)

    return sync


def _sequence_number() -> int:
    """Sequence number the next autograd node will get (nodes are numbered per thread)."""
    return torch.autograd._get_sequence_nr()


@contextmanager
def moved_to(module: nn.Module, device: torch.device) -> Iterator[None]:
    """``module``'s parameters and buffers on ``device`` inside the block, and afterwards as
    found: the same tensor objects (an optimizer made before keeps its parameters), on their
    devices, with their values and gradients.

    The tensors' ``.data`` move instead of ``module.to(device)``, which makes new buffer objects
    and would leave a :class:`Snapshot` restoring the old ones. Gradients are set aside while
    the data is elsewhere: a gradient must be on its tensor's device.
    """
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
    saved = [(t, t.data, t.grad) for t in tensors if t.device != device]
    try:
        for tensor, data, _ in saved:
            tensor.grad = None
            tensor.data = data.to(device)
        yield
    finally:
        for tensor, data, grad in saved:
            tensor.grad = None
            tensor.data = data
            tensor.grad = grad


@contextmanager
def on_meta(module: nn.Module) -> Iterator[None]:
    """``module``'s real parameters and buffers on the ``meta`` device inside the block (the
    same objects; values back afterwards), to run it with a model created partly without
    memory."""
    twins = []
    try:
        for tensor in {id(t): t for t in _module_tensors(module) if not t.is_meta}.values():
            twins.append((tensor, swap_in(tensor, tensor.detach().to(META))))
        yield
    finally:
        for tensor, twin in twins:
            torch.utils.swap_tensors(tensor, twin)


def profile_without_memory(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> ModelProfile:
    """The structure profile (calls, sizes, operation counts; no times) of a model created
    partly or wholly without memory, run on the meta device where its tensors are involved
    (:class:`_MixedOnMeta`)."""
    kwargs = dict(kwargs or {})
    with on_meta(module), _MixedOnMeta(_real_device((args, kwargs))):
        return profile_module(module, args, kwargs, repeats=0, progress=progress)


def outputs_without_memory(
    module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Any:
    """The outputs of a model created partly or wholly without memory, run as in
    :func:`profile_without_memory`: those computed on the meta device as zeros of their shapes
    on the arguments' device, so that the step's own code around the model goes on."""
    device = _real_device((args, kwargs))
    with on_meta(module), _MixedOnMeta(device), torch.no_grad():
        outputs = module(*args, **kwargs)
    return tree_map_only(
        Tensor,
        lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device) if t.is_meta else t,
        outputs,
    )


def _real_device(tree: Any) -> torch.device:
    """The device of the first real tensor in ``tree``; the CPU if none."""
    real = (t.device for t in _unique_tensors(tree) if not t.is_meta)
    return next(real, torch.device("cpu"))


class _MixedOnMeta(TorchDispatchMode):
    """Runs an operation that mixes real tensors with meta ones on meta twins of the real ones;
    operations on real tensors alone run as they are, and tensors made from nothing for the
    meta device (``torch.arange(n, device=hidden.device)``) are made real on ``device``, so
    that the model's code may still read values that do not come from its parameters (a mask's
    padding, packed sequences in Llama's position ids)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        flat = tree_flatten((args, kwargs))[0]
        if is_factory(func, flat) and kwargs.get("device") == META:
            kwargs["device"] = self.device
        elif any(isinstance(v, Tensor) and v.is_meta for v in flat):
            args, kwargs = meta_twins((args, kwargs))
            if kwargs.get("device") is not None:  # ``meta_tensor.to(device)`` stays meta
                kwargs["device"] = META
        return func(*args, **kwargs)


class Snapshot:
    """Gradients, buffers and RNG state, so passes repeat and the model is left as found."""

    def __init__(self, module: nn.Module, input_leaves: list[Tensor], cuda: bool) -> None:
        self.leaves = [*module.parameters(), *input_leaves]
        self.grads = [t.grad for t in self.leaves]
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if cuda else None

    def reset(self) -> None:
        for t in self.leaves:
            t.grad = None
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore(self) -> None:
        self.reset()
        for t, grad in zip(self.leaves, self.grads, strict=True):
            t.grad = grad


# --------------------------------------------------------------------------------------------
# Recording

_OFF, _STRUCTURE, _TIMED = 0, 1, 2


@dataclass
class _Frame:
    """An open call in a timed pass."""

    call: int
    start: float = 0.0
    children: float = 0.0
    overhead: float = 0.0


@dataclass
class _Pass:
    """One timed pass: per module ``[fwd incl, fwd excl, bwd incl, bwd excl]``, calls summed."""

    modules: dict[str, list[float]]
    forward: float
    backward: float | None
    unattributed: float


class _Recorder:
    """Module hooks for the structure pass and the timed passes."""

    def __init__(
        self, profile: ModelProfile, param_owners: dict[int, str], sync: Callable[[], None]
    ) -> None:
        self.profile = profile
        self._param_owners = param_owners
        self.sync = sync
        self.mode = _OFF
        # Structure pass.
        self._known: dict[int, Tensor] = {}
        self._stack: list[int] = []
        # Timed pass.
        self._frames: list[_Frame] = []
        self._timed: list[tuple[str, int]] = []
        self._fwd: list[tuple[float, float]] = []
        self._marks: list[int] = []
        self._mark_owner: list[int] = []

    def pre_hook(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.mode == _TIMED:
            self._pre_timed(name)
        elif self.mode == _STRUCTURE:
            self._pre_structure(name, args, kwargs)

    def post_hook(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.mode == _TIMED:
            self._post_timed()
        elif self.mode == _STRUCTURE:
            self._post_structure(name, output)

    # -- structure pass ------------------------------------------------------------------
    def start_structure(self, inputs: list[Tensor]) -> None:
        # Holding the tensors keeps their id() from being reused during the pass.
        self._known = {id(t): t for t in inputs}
        self.mode = _STRUCTURE

    def end_structure(self) -> None:
        self.mode = _OFF
        self._known.clear()
        self._stack.clear()

    def _pre_structure(self, name: str, args: Any, kwargs: Any) -> None:
        calls = self.profile.calls
        index = len(calls)
        caller = self._stack[-1] if self._stack else -1
        size = sum(_nbytes(t) for t in _unique_tensors((args, kwargs)))
        calls.append(ProfiledCall(index=index, module=name, caller=caller, input_bytes=size))
        self._stack.append(index)
        entry = self.profile.modules[name]
        entry.calls += 1
        if entry.order is None:
            entry.order = index

    def _post_structure(self, name: str, output: Any) -> None:
        if not self._stack:
            return
        index = self._stack.pop()
        total = created = 0
        for t in _unique_tensors(output):
            total += _nbytes(t)
            if id(t) not in self._known:  # not a child's output or an input passed on
                self._known[id(t)] = t
                created += _nbytes(t)
        self.profile.calls[index].output_bytes = total
        self.profile.modules[name].activation_bytes += created

    # -- timed passes --------------------------------------------------------------------
    def start_timed(self) -> None:
        self._frames.clear()
        self._timed.clear()
        self._fwd.clear()
        self._marks.clear()
        self._mark_owner.clear()
        self.mode = _TIMED

    def _mark(self, owner: int) -> None:
        """From the next autograd node on, nodes belong to call ``owner``."""
        self._marks.append(_sequence_number())
        self._mark_owner.append(owner)

    def _pre_timed(self, name: str) -> None:
        enter = time.perf_counter()
        caller = self._frames[-1].call if self._frames else -1
        index = len(self._timed)
        self._timed.append((name, caller))
        self._fwd.append((0.0, 0.0))
        self._mark(index)
        frame = _Frame(index)
        overhead = time.perf_counter() - enter
        for outer in self._frames:
            outer.overhead += overhead
        self._frames.append(frame)
        self.sync()
        frame.start = time.perf_counter()

    def _post_timed(self) -> None:
        self.sync()
        end = time.perf_counter()
        if not self._frames:
            return
        frame = self._frames.pop()
        inclusive = max(0.0, end - frame.start - frame.overhead)
        self._fwd[frame.call] = (inclusive, max(0.0, inclusive - frame.children))
        if self._frames:
            self._frames[-1].children += inclusive
        self._mark(self._frames[-1].call if self._frames else -1)
        overhead = time.perf_counter() - end
        for outer in self._frames:
            outer.overhead += overhead

    def timed_backward(self, loss: Tensor) -> tuple[float, list[float], float]:
        """Backward with a clock on every node: (wall time, exclusive per call, unattributed)."""
        nodes = _graph_nodes(loss.grad_fn)
        starts = [0.0] * len(nodes)
        durations = [0.0] * len(nodes)
        sync = self.sync

        def pre(i: int, grad_outputs: Any) -> None:
            sync()
            starts[i] = time.perf_counter()

        def post(i: int, grad_inputs: Any, grad_outputs: Any) -> None:
            sync()
            durations[i] += time.perf_counter() - starts[i]

        for i, node in enumerate(nodes):
            node.register_prehook(partial(pre, i))
            node.register_hook(partial(post, i))
        sync()
        start = time.perf_counter()
        loss.backward()
        sync()
        elapsed = time.perf_counter() - start

        exclusive = [0.0] * len(self._timed)
        param_call = self._parameter_calls()
        unattributed = 0.0
        for node, duration in zip(nodes, durations, strict=True):
            variable = getattr(node, "variable", None)
            if isinstance(variable, Tensor):  # AccumulateGrad: the owner's parameter update
                call = param_call.get(id(variable), -1)
            else:
                position = bisect.bisect_right(self._marks, node._sequence_nr()) - 1
                call = self._mark_owner[position] if position >= 0 else -1
            if call < 0:
                unattributed += duration
            else:
                exclusive[call] += duration
        return elapsed, exclusive, unattributed

    def _parameter_calls(self) -> dict[int, int]:
        """``id(parameter) -> first call`` of its owner, or of the nearest ancestor that ran
        (a module that never runs has its parameters used by other code, usually its parent's)."""
        first_call: dict[str, int] = {}
        for index, (timed, _) in enumerate(self._timed):
            first_call.setdefault(timed, index)
        modules = self.profile.modules
        calls: dict[int, int] = {}
        for param_id, owner in self._param_owners.items():
            name: str | None = owner
            while name is not None and name not in first_call:
                name = modules[name].parent
            if name is not None:
                calls[param_id] = first_call[name]
        return calls

    def end_timed(self, forward: float, timing: tuple[float, list[float], float] | None) -> _Pass:
        """This pass's times per module, calls summed; inclusive backward adds the callees'."""
        self.mode = _OFF
        count = len(self._timed)
        backward, exclusive, unattributed = timing or (None, [0.0] * count, 0.0)
        inclusive = list(exclusive)
        for index in range(count - 1, -1, -1):  # callers start before the calls they make
            caller = self._timed[index][1]
            if caller >= 0:
                inclusive[caller] += inclusive[index]
        modules: dict[str, list[float]] = {}
        for index, (name, _) in enumerate(self._timed):
            values = modules.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            fwd_incl, fwd_excl = self._fwd[index]
            values[0] += fwd_incl
            values[1] += fwd_excl
            values[2] += inclusive[index]
            values[3] += exclusive[index]
        return _Pass(modules, forward, backward, unattributed)


def _graph_nodes(root: Any) -> list[Any]:
    """Every autograd node reachable from ``root`` (held, so their Python objects stay alive)."""
    if root is None:
        return []
    nodes = [root]
    seen = {id(root)}
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                nodes.append(child)
                stack.append(child)
    return nodes


def _fold(profile: ModelProfile, passes: list[_Pass]) -> None:
    """Median over the timed passes of every time (a module absent from a pass counts 0)."""
    for name, entry in profile.modules.items():
        values = [p.modules.get(name, [0.0, 0.0, 0.0, 0.0]) for p in passes]
        medians = [statistics.median(column) for column in zip(*values, strict=True)]
        entry.forward_time, entry.forward_exclusive = medians[0], medians[1]
        entry.backward_time, entry.backward_exclusive = medians[2], medians[3]
    profile.forward_time = statistics.median(p.forward for p in passes)
    backwards = [p.backward for p in passes if p.backward is not None]
    profile.backward_measured = bool(backwards)
    profile.backward_time = statistics.median(backwards) if backwards else 0.0
    profile.unattributed_backward_time = statistics.median(p.unattributed for p in passes)

"""Models created without memory, each rank later making only its own share, with eager values.

Inside :func:`delay_param_initialization` every tensor the model's code creates lives on the
``meta`` device (shapes and dtypes, no memory), and every operation on those tensors is recorded
in order: the factories, the initialisers (``normal_``, ``uniform_``, ``zero_``, copies between
parameters, views of them). :func:`materialize` later replays, on a real device, only the
operations the tensors a rank owns depend on (a backward slice over storages), so no rank ever
holds the whole model.

**Why the values are exactly the eager ones.** An initialiser draws from a random generator, and
the values it gets depend on where the generator's stream stands when it runs. While recording,
each random operation is run once for real on a scratch tensor of the same storage size, layout
and dtype, on the device the model would have been created on, after saving that generator's
state: the stream advances exactly as in eager creation (so code after the block draws the same
numbers too), the scratch is freed at once (the largest single tensor is the most a rank holds
for it), and the replay of that operation starts from the saved state, on a tensor of the same
layout, so it draws the same numbers eager creation did. Everything else is deterministic and
replays as recorded. Across ranks, :func:`sync_random_states` gives every rank rank 0's saved
states, so ranks seeded apart still build rank 0's model, as eager ranks take rank 0's values.

What cannot be deferred fails inside the block, naming the module: code that reads a tensor's
value during creation (``.item()``, ``if tensor.any()``), which a tensor without memory does not
have, and the initialisers of ``torch.nn.init`` that return at once on a tensor without memory
(:data:`SKIP_META`: ``trunc_normal_``, ViT's class token and positions, whose rejection sampling
reads values; ``orthogonal_``; ``dirac_``; ``sparse_``), leaving it unrecorded and the random
stream behind eager creation's (refused where looked up when called: a reference to one of the
last three bound before the block is not seen). Parameters changed after the block
(outside the recording) are refused at :func:`materialize`, naming the parameter.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

from dtrain.modelparallel.errors import ModelParallelError

META = torch.device("meta")

_RECORDINGS: dict[int, Recording] = {}
"""Storage key → the recording that made it (recordings keep their storages alive, so a key is
never reused while it is listed here)."""

_COUNTER = itertools.count()

SKIP_META = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")
"""torch.nn.init's initialisers that return at once on a meta tensor (torch 2.13): refused
inside :func:`delay_param_initialization`."""


def storage_key(tensor: Tensor) -> int:
    """Identity of a tensor's storage: views and ``.data`` aliases share it."""
    return tensor.untyped_storage()._cdata


def is_deferred(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a recorded tensor not yet made real."""
    return tensor.is_meta and storage_key(tensor) in _RECORDINGS


@dataclass(frozen=True)
class _Ref:
    """A recorded tensor: a view of a recorded storage."""

    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: Tensor) -> _Ref:
        return cls(
            storage_key(tensor),
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),  # an int here: recorded tensors have real shapes
        )


@dataclass(frozen=True)
class _Op:
    func: torch._ops.OpOverload
    args: Any
    kwargs: Any
    outputs: Any
    reads: frozenset[int]
    writes: frozenset[int]
    random: int | None
    """Index of the generator state saved before it, for a random operation."""


@dataclass
class _RandomState:
    generator: torch.Generator
    state: Tensor


class Recording:
    """The operations of one :func:`delay_param_initialization` block, replayable in part."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.index = next(_COUNTER)
        self.device = device
        """Where eager creation would have put the tensors; replays run there."""
        self.dtype = dtype
        """The default dtype inside the block; replays run under it."""
        self.ops: list[_Op] = []
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.random_states: list[_RandomState] = []
        self._scratch_storages: list[torch.UntypedStorage] = []
        """Reused by every random operation's scratch tensors: allocating one per operation
        leaves the allocator's heap holding as much as the whole model."""

    # --- recording ---------------------------------------------------------------------------

    def _ref(self, tensor: Tensor) -> _Ref:
        key = storage_key(tensor)
        if key not in self.storages:
            known = _RECORDINGS.get(key)
            if known is not None and known is not self:
                raise ModelParallelError(
                    "smp.delay_param_initialization: a tensor made in another delayed block "
                    "was used in this one; create the whole model in one block"
                )
            self.storages[key] = tensor.untyped_storage()
            _RECORDINGS[key] = self
        return _Ref.of(tensor)

    def record(
        self, func: torch._ops.OpOverload, args: Any, kwargs: Any, out: Any, random: bool
    ) -> None:
        """Log ``func``; a ``random`` one replays from the generator state saved last (by
        :meth:`advance_random`)."""
        reads: set[int] = set()

        def read(value: Any) -> Any:
            if isinstance(value, Tensor) and value.is_meta:
                if storage_key(value) not in _RECORDINGS:
                    raise _unknown_meta(func)
                ref = self._ref(value)
                reads.add(ref.key)
                return ref
            return value

        # Arguments are read before the call produced ``out``; views in ``out`` share their keys.
        args_rec, kwargs_rec = tree_map(read, (args, kwargs))
        writes = {ref.key for ref in _mutated(func, args_rec, kwargs_rec)}
        outputs = tree_map(
            lambda v: self._ref(v) if isinstance(v, Tensor) and v.is_meta else None, out
        )
        writes.update(ref.key for ref in tree_flatten(outputs)[0] if isinstance(ref, _Ref))
        state = len(self.random_states) - 1 if random else None
        self.ops.append(
            _Op(func, args_rec, kwargs_rec, outputs, frozenset(reads), frozenset(writes), state)
        )

    def advance_random(self, func: torch._ops.OpOverload, args: Any, kwargs: Any) -> None:
        """Save the generator's state, then draw what eager creation would (see the module)."""
        generator = kwargs.get("generator") or _default_generator(self.device)
        self.random_states.append(_RandomState(generator, generator.get_state()))
        scratch = _Scratch(self.device, self._scratch_storages)
        real_args, real_kwargs = tree_map(scratch.twin, (args, kwargs))
        try:
            func(*real_args, **real_kwargs)
        except RuntimeError as exc:
            raise ModelParallelError(
                f"smp.delay_param_initialization: the random operation {func} could not be "
                f"reproduced on {self.device} ({exc}); create this model outside the block"
            ) from exc

    def done(self) -> None:
        """The block ended: let the scratch memory go."""
        self._scratch_storages.clear()

    # --- replaying ---------------------------------------------------------------------------

    def replay(self, targets: Iterable[Tensor]) -> list[Tensor]:
        """Real tensors for ``targets`` (recorded tensors), computed by the operations they
        depend on; generators are left as found."""
        refs = [_Ref.of(t) for t in targets]
        needed = self._slice({ref.key for ref in refs})
        real: dict[int, torch.UntypedStorage] = {}
        generators = {id(rs.generator): rs.generator for rs in self.random_states}.values()
        saved = [(generator, generator.get_state()) for generator in generators]
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            for op in needed:
                self._run(op, real)
        finally:
            torch.set_default_dtype(previous)
            for generator, state in saved:
                generator.set_state(state)
        missing = [ref for ref in refs if ref.key not in real]
        if missing:
            raise ModelParallelError(
                f"smp.delay_param_initialization: no recorded operation made a tensor of shape "
                f"{list(missing[0].size)}"
            )
        return [self._view(ref, real) for ref in refs]

    def _slice(self, keys: set[int]) -> list[_Op]:
        """The operations writing ``keys`` and, transitively, those writing what they read."""
        needed: list[_Op] = []
        wanted = set(keys)
        for op in reversed(self.ops):
            if op.writes & wanted:
                needed.append(op)
                wanted |= op.reads
        needed.reverse()
        return needed

    def _view(self, ref: _Ref, real: dict[int, torch.UntypedStorage]) -> Tensor:
        tensor = torch.empty(0, dtype=ref.dtype, device=self.device)
        return tensor.set_(real[ref.key], ref.offset, ref.size, ref.stride)

    def _run(self, op: _Op, real: dict[int, torch.UntypedStorage]) -> None:
        def arg(value: Any) -> Any:
            if isinstance(value, _Ref):
                if value.key not in real:  # read before any recorded write: uninitialised
                    nbytes = self.storages[value.key].nbytes()
                    real[value.key] = torch.UntypedStorage(nbytes, device=self.device)
                return self._view(value, real)
            if isinstance(value, torch.device) and value == META:
                return self.device
            return value

        args, kwargs = tree_map(arg, (op.args, op.kwargs))
        if op.random is not None:
            rs = self.random_states[op.random]
            rs.generator.set_state(rs.state)
        out = op.func(*args, **kwargs)
        refs, _ = tree_flatten(op.outputs)
        values, _ = tree_flatten(out)
        for ref, value in zip(refs, values, strict=True):
            if isinstance(ref, _Ref) and ref.key not in real:
                real[ref.key] = value.untyped_storage()


class _Scratch:
    """Real twins of one operation's meta tensors: same storage size, layout and dtype (what
    the generator's consumption depends on), zeros, in reused storages."""

    def __init__(self, device: torch.device, storages: list[torch.UntypedStorage]) -> None:
        self.device = device
        self.storages = storages
        self.used = 0

    def twin(self, value: Any) -> Any:
        if isinstance(value, torch.device) and value == META:
            return self.device
        if not (isinstance(value, Tensor) and value.is_meta):
            return value
        nbytes = value.untyped_storage().nbytes()
        if self.used == len(self.storages):
            self.storages.append(torch.UntypedStorage(0, device=self.device))
        storage = self.storages[self.used]
        self.used += 1
        if storage.nbytes() < nbytes:
            storage.resize_(nbytes)
        scratch = torch.empty(0, dtype=value.dtype, device=self.device)
        scratch.set_(storage, value.storage_offset(), value.shape, value.stride())
        return scratch.zero_() if scratch.numel() else scratch


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise ModelParallelError(
        f"smp.delay_param_initialization: models created on {device} cannot be delayed "
        "(create them on the CPU or a GPU)"
    )


def _mutated(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> list[_Ref]:
    """The recorded tensors ``func`` writes in place (its schema's mutable arguments)."""
    refs: list[_Ref] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only else None
        if not argument.kwarg_only:
            value = args[position] if position < len(args) else kwargs.get(argument.name)
        flat, _ = tree_flatten(value)
        refs.extend(v for v in flat if isinstance(v, _Ref))
    return refs


def _unknown_meta(func: torch._ops.OpOverload) -> ModelParallelError:
    return ModelParallelError(
        f"smp.delay_param_initialization: {func} used a meta tensor made outside the block; "
        "a delayed model must be created, and initialised, inside one block"
    )


class _Recorder(TorchDispatchMode):
    """Sends the factories meant for the creation device to ``meta`` and records every
    operation on meta tensors. The default device stays as it was (models that look at it,
    as Hugging Face's do, would skip their initialisation on a meta default)."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(
        self, func: torch._ops.OpOverload, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        flat, _ = tree_flatten((args, kwargs))
        if is_factory(func, flat) and self._creation_device(kwargs.get("device")):
            kwargs["device"] = META
        involved = kwargs.get("device") == META or any(
            isinstance(v, Tensor) and v.is_meta for v in flat
        )
        if not involved:
            return func(*args, **kwargs)
        random = torch.Tag.nondeterministic_seeded in func.tags
        if random:
            self.recording.advance_random(func, args, kwargs)
        meta_args, meta_kwargs = _on_meta(func, args, kwargs)
        out = func(*meta_args, **meta_kwargs)
        self.recording.record(func, args, kwargs, out, random)
        return out

    def _creation_device(self, device: torch.device | None) -> bool:
        if device is None:
            return True
        wanted = self.recording.device
        return device.type == wanted.type and device.index in (None, wanted.index)


def _on_meta(func: torch._ops.OpOverload, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The arguments with real tensors (constants such as ``torch.tensor([...])``, which stay
    real) as meta twins, for an operation that mixes them with meta tensors; the recording
    keeps the real ones for the replay. Writing into a real tensor from a meta one cannot be
    deferred."""
    for argument, value in zip(func._schema.arguments, args, strict=False):
        written = argument.alias_info is not None and argument.alias_info.is_write
        if written and isinstance(value, Tensor) and not value.is_meta:
            raise ModelParallelError(
                f"smp.delay_param_initialization: {func} writes values of the model's tensors "
                "into a tensor created outside the model's memory-free creation; create that "
                "tensor inside the block too"
            )
    return meta_twins((args, kwargs))


def meta_twins(tree: Any) -> Any:
    """``tree`` with each real tensor replaced by a meta tensor of its shape and dtype."""
    return tree_map_only(Tensor, lambda t: t if t.is_meta else t.detach().to(META), tree)


def is_factory(func: torch._ops.OpOverload, flat: list[Any]) -> bool:
    """An operation making tensors from nothing but sizes and options (``empty``, ``randn``)."""
    schema = func._schema
    return (
        not any(isinstance(v, Tensor) for v in flat)
        and any(argument.name == "device" for argument in schema.arguments)
        and any("Tensor" in str(ret.type) for ret in schema.returns)
    )


@contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """``smp.delay_param_initialization``: create the model inside the block without memory;
    ``smp.DistributedModel`` makes each rank's own modules at the first step."""
    if not enabled:
        yield
        return
    device = torch.get_default_device()
    recording = Recording(device, torch.get_default_dtype())
    restore = _refuse_skipping_inits()
    try:
        with _Recorder(recording):
            yield
    except BaseException as exc:
        if isinstance(exc, _SkipsMeta):
            raise ModelParallelError(
                f"smp.delay_param_initialization: {_creating_module(exc.__traceback__)} "
                f"initialises a tensor with torch.nn.init.{exc.args[0]}, which returns at once "
                "on a tensor without memory, so it would be made unlike eager creation. Create "
                "this model outside the block (without delayed_parameter_initialization)"
            ) from exc
        if _reads_a_value(exc):
            raise ModelParallelError(
                "smp.delay_param_initialization: "
                f"{_creating_module(exc.__traceback__)} read a tensor's value during creation "
                f"({exc}); a tensor created without memory has none. Create this model "
                "outside the block, or move that code after the first step"
            ) from exc
        raise
    finally:
        for table, key, original in restore:
            table[key] = original
        recording.done()


class _SkipsMeta(RuntimeError):
    """An initialiser of :data:`SKIP_META` (``args[0]``) was called on a tensor without
    memory."""


def _refuse_skipping_inits() -> list[tuple[dict[str, Any], str, Callable[..., Tensor]]]:
    """Make :data:`SKIP_META` fail on a tensor without memory wherever it is looked up: torch's
    names (``trunc_normal_`` through its sampler, which every alias calls), the deprecated
    aliases (which hold the original), and Hugging Face's table of torch's originals
    (``transformers.initialization.TORCH_INIT_FUNCTIONS``, if imported). Returns what to put
    back."""
    init = vars(torch.nn.init)
    tables = [(init, "_no_grad_trunc_normal_", "trunc_normal_")]
    for name in SKIP_META[1:]:
        tables += [(init, name, name), (init, name.rstrip("_"), name)]
    hf = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    if isinstance(hf, dict):
        tables += [(hf, name, name) for name in SKIP_META[1:] if hf.get(name) is init[name]]
    restore = []
    for table, key, name in tables:
        original = table[key]
        table[key] = _refusing(original, name)
        restore.append((table, key, original))
    return restore


def _refusing(original: Callable[..., Tensor], name: str) -> Callable[..., Tensor]:
    def init(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if tensor.is_meta:
            raise _SkipsMeta(name)
        return original(tensor, *args, **kwargs)

    return init


def _reads_a_value(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (RuntimeError, NotImplementedError)) and (
        "meta" in text and ("item()" in text or "data-dependent" in text or "no data" in text)
    )


def _creating_module(tb: TracebackType | None) -> str:
    """``Class (file:line)`` of the innermost module whose code was running."""
    found = "the model's code"
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            code = tb.tb_frame.f_code
            found = f"{type(owner).__qualname__} ({code.co_filename}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found


def recordings_of(tensors: Iterable[Tensor]) -> list[Recording]:
    """The recordings the deferred ``tensors`` came from, in the order they were made."""
    found = {id(r): r for t in tensors if (r := _RECORDINGS.get(storage_key(t))) and t.is_meta}
    return sorted(found.values(), key=lambda r: r.index)


def materialize(tensors: Iterable[Tensor], device: torch.device) -> None:
    """Make the deferred ``tensors`` real on ``device``, in place (the same Python objects, so
    an optimizer made before keeps them); tensors already real are left alone."""
    pending = list({id(t): t for t in tensors if t.is_meta}.values())
    by_recording: dict[int, tuple[Recording, list[Tensor]]] = {}
    for tensor in pending:
        recording = _RECORDINGS.get(storage_key(tensor))
        if recording is None:
            raise ModelParallelError(
                f"a parameter or buffer of shape {list(tensor.shape)} is on the meta device "
                "but was not made inside smp.delay_param_initialization(): it was replaced or "
                "created after the block; do that inside it"
            )
        by_recording.setdefault(recording.index, (recording, []))[1].append(tensor)
    for recording, group in by_recording.values():
        values = recording.replay(group)
        for tensor, value in zip(group, values, strict=True):
            swap_in(tensor, value.to(device))


def swap_in(tensor: Tensor, value: Tensor) -> Tensor:
    """Give the Python object ``tensor`` the contents of ``value`` (any device), keeping its
    kind (parameter or not), ``requires_grad`` and its attributes (marks such as tensor
    parallelism's, set while it had no memory): ``.data`` cannot cross to or from meta, and a
    swap swaps the attributes too. Returns the object that holds ``tensor``'s old contents (a
    parameter's ``value`` is wrapped anew): swapping the two back restores it."""
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
    else:
        value.requires_grad_(tensor.requires_grad)
    vars(value).update(vars(tensor))
    torch.utils.swap_tensors(tensor, value)
    return value


def empty_in_place(tensor: Tensor, device: torch.device) -> None:
    """Make ``tensor`` (eager or created without memory) an empty tensor on ``device``,
    keeping the Python object, its dtype and its kind: another rank's share, as every rank's
    model holds it.

    A DTensor (a tensor made of other tensors) is swapped with an empty one of its layout:
    ``.data`` would change its wrapper only, and the local shard inside would stay held."""
    if is_traceable_wrapper_subclass(tensor):
        swap_in(tensor, _empty_distributed(tensor, device))
        return
    empty = torch.empty(0, dtype=tensor.dtype, device=device)
    if tensor.is_meta:  # .data cannot leave meta
        swap_in(tensor, empty)
    else:
        tensor.data = empty


def _empty_distributed(tensor: Any, device: torch.device) -> Tensor:
    """A DTensor with no elements, on ``tensor``'s mesh and placements (its dimensions kept, so
    every placement still names one). Duck-typed: DTensor takes a second to import."""
    sizes = (0,) * tensor.dim()
    return type(tensor).from_local(
        torch.empty(sizes, dtype=tensor.dtype, device=device),
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=sizes,
        stride=(1,) * tensor.dim(),
    )


def sync_random_states(
    recordings: list[Recording], exchange: Callable[[list[Tensor]], list[Tensor]]
) -> None:
    """Use rank 0's saved generator states (``exchange`` returns them, given this rank's)."""
    mine = [rs.state for recording in recordings for rs in recording.random_states]
    theirs = exchange(mine)
    if len(theirs) != len(mine):
        raise ModelParallelError(
            "smp.delay_param_initialization: ranks created different models (rank 0 drew "
            f"random numbers {len(theirs)} times, this rank {len(mine)} times)"
        )
    states = iter(theirs)
    for recording in recordings:
        for rs in recording.random_states:
            rs.state = next(states)

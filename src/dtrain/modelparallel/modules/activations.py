"""Activation checkpointing (``smp.set_activation_checkpointing``) and activation offloading,
for modules on any pipeline partition, or in a sharded model.

A checkpointed module keeps only its inputs for backward; what its forward computed in between
is recomputed when backward reaches it. The recomputation has to run where the module runs:
on the leader for modules it owns, on the owner for a module another partition owns (a remote
call's forward and backward both run there, :mod:`..pipeline.owner`). So a mark only records
what to checkpoint; the runtime wraps the forward of each marked module on the rank that owns it
(:func:`plan_checkpointing`, :func:`checkpointed`), with torch's non-reentrant
``torch.utils.checkpoint``. A module whose submodules live on several partitions cannot be
recomputed in one place: its largest subtrees that each run on one partition are recomputed
where they run, and its own code between them keeps its activations. A single call is
checkpointed by SMP's ``checkpoint`` (:mod:`.checkpoint`).

A sharded model (``sharded_data_parallel_degree`` > 1, no pipeline) plans its marks as one
partition and wraps the forwards at its first step too (:mod:`..api.sharded`).

Offloading (``offload_activations``, GPUs only): a checkpointed module's inputs, the only
activations it keeps, are copied to pinned host memory in its forward; its recomputation copies
them back to the device first (:func:`_offloaded_call`). On a CPU there is nothing to offload.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn

from dtrain.errors import ConfigError, did_you_mean
from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.transport.structure import flatten, unflatten


@dataclass(frozen=True)
class CheckpointSpec:
    """How a module is checkpointed (SMP's arguments)."""

    preserve_rng_state: bool = True
    pack_args_as_tuple: bool = False
    strategy: str = "each"


_marks: weakref.WeakKeyDictionary[nn.Module, CheckpointSpec] = weakref.WeakKeyDictionary()
_unclaimed: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Modules marked while no ``DistributedModel`` was there to check that they belong to it."""
_lock = threading.Lock()


def group_size(strategy: object) -> int | None:
    """Children per group for ``strategy``: 1 (``each``), None (``contiguous``: all children
    in a row on one partition) or ``n`` (``group_<n>``); anything else fails naming it."""
    if strategy == "each":
        return 1
    if strategy == "contiguous":
        return None
    if isinstance(strategy, str) and strategy.startswith("group_"):
        digits = strategy.removeprefix("group_")
        if digits.isdigit() and int(digits) >= 1:
            return int(digits)
    hint = (
        did_you_mean(str(strategy), ("each", "contiguous")) if isinstance(strategy, str) else None
    )
    raise ConfigError(
        "set_activation_checkpointing.strategy",
        strategy,
        '"each", "contiguous" or "group_<n>" with an integer n >= 1',
        hint,
    )


def _model_modules() -> set[int] | None:
    """ids of the registered model's modules (None without one); a model whose first step has
    wrapped the forwards (the pipeline runtime, or the sharded model) fails the call."""
    model = state.current_model() if state.is_initialized() else None
    if model is None:
        return None
    if model.forwards_set_up:
        raise ModelParallelError(
            "smp.set_activation_checkpointing was called after the model's first step; the "
            "modules' forwards were set up then: mark the modules before the first step"
        )
    return {id(m) for m in model.module.modules()}


def kept_whole(root: nn.Module) -> set[str]:
    """Names of ``root``'s marked modules other than ``nn.Sequential`` ones: each is
    checkpointed as one region, so the automatic planner keeps it on one partition (a
    Sequential's strategy groups only children on one partition)."""
    names = {id(m): name for name, m in root.named_modules()}
    with _lock:
        marked = [m for m in _marks if id(m) in names and not isinstance(m, nn.Sequential)]
    return {names[id(m)] for m in marked}


def marks_inside(root: nn.Module) -> bool:
    """Whether some module of ``root`` is marked for checkpointing."""
    inside = {id(m) for m in root.modules()}
    with _lock:
        return any(id(m) in inside for m in _marks)


def checkpointing_partitions(root: nn.Module, owners: dict[str, int]) -> set[int]:
    """The partitions that run a part of ``root``'s marked modules (by ``owners``, module name
    to partition): their backwards recompute, so they run whole (see
    :mod:`..pipeline.split_backward`), and a plan must not split them."""
    with _lock:
        marked = list(_marks)
    inside = {id(each) for m in marked for each in m.modules()}
    return {owners[name] for name, m in root.named_modules() if id(m) in inside}


def set_activation_checkpointing(
    module: nn.Module,
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
    strategy: str = "each",
) -> None:
    """Checkpoint ``module`` wherever it runs (before or after ``smp.DistributedModel``, before
    the first step). For an ``nn.Sequential``, ``strategy`` groups its children (``each``,
    ``contiguous``, ``group_<n>``; a group never spans partitions) and ``pack_args_as_tuple``
    is accepted: torch's non-reentrant checkpointing passes a tuple input through as it is,
    which SMP's flag was needed for. An ``nn.ModuleList`` (or ``ModuleDict``) marks each of
    its layers."""
    what = "smp.set_activation_checkpointing"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what} takes an nn.Module, got {type(module).__name__}")
    if state.is_initialized() and module is state.current_model():
        raise ModelParallelError(
            f"{what}: got the smp.DistributedModel itself; pass a module inside it "
            "(model.module or one of its submodules)"
        )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        if strategy != "each" or pack_args_as_tuple:
            raise ModelParallelError(
                f"{what}: a {type(module).__name__} has no forward of its own (its parent calls "
                f"its layers one at a time), so its layers are checkpointed each on its own; "
                f"got strategy={strategy!r}, pack_args_as_tuple={pack_args_as_tuple}; allowed: "
                "strategy='each', pack_args_as_tuple=False (or an nn.Sequential to group layers)"
            )
        for layer in module.children():  # as AWS's GPT-NeoX script marks HF's layer list
            set_activation_checkpointing(layer, preserve_rng_state)
        return
    for key, value in (
        ("preserve_rng_state", preserve_rng_state),
        ("pack_args_as_tuple", pack_args_as_tuple),
    ):
        if not isinstance(value, bool):
            raise ConfigError(f"set_activation_checkpointing.{key}", value, "True or False")
    group_size(strategy)
    if not isinstance(module, nn.Sequential) and (pack_args_as_tuple or strategy != "each"):
        given = "pack_args_as_tuple=True" if pack_args_as_tuple else f"strategy={strategy!r}"
        raise ConfigError(
            "set_activation_checkpointing",
            given,
            "pack_args_as_tuple and strategy only for an nn.Sequential, not "
            f'{type(module).__name__} (leave them at False and "each")',
        )
    known = _model_modules()
    if known is not None and id(module) not in known:
        raise ModelParallelError(
            f"{what}: the {type(module).__name__} passed is not part of the model given to "
            "smp.DistributedModel; pass one of its modules"
        )
    with _lock:
        _marks[module] = CheckpointSpec(preserve_rng_state, pack_args_as_tuple, strategy)
        if known is None:
            _unclaimed.add(module)


def carry_over(original: nn.Module, replacement: nn.Module) -> None:
    """Tensor parallelism swaps ``original`` for ``replacement``: its checkpointing mark moves
    along. A mark on a module inside ``original`` has no counterpart: that fails, naming it."""
    with _lock:
        inner = [name for name, m in original.named_modules() if name and m in _marks]
        if inner:
            raise ModelParallelError(
                f"smp.set_activation_checkpointing marked its submodule {inner[0]!r}, which the "
                f"swap replaces with {type(replacement).__name__}; mark the distributed module's "
                "layers after smp.DistributedModel (model.module...) instead"
            )
        spec = _marks.pop(original, None)
        if spec is None:
            return
        if not isinstance(replacement, nn.Sequential) and spec != CheckpointSpec(
            spec.preserve_rng_state
        ):
            raise ModelParallelError(
                f"smp.set_activation_checkpointing: strategy={spec.strategy!r} and "
                f"pack_args_as_tuple={spec.pack_args_as_tuple} were given for an nn.Sequential "
                f"that the swap replaces with {type(replacement).__name__}; allowed: the defaults"
            )
        _marks[replacement] = spec
        if original in _unclaimed:
            _unclaimed.discard(original)
            _unclaimed.add(replacement)


# --- at the first step: what each rank wraps -------------------------------------------------


@dataclass(frozen=True)
class Group:
    """Consecutive children of a checkpointed ``nn.Sequential``, checkpointed as one region
    where the Sequential runs (``together``) or each on its own owner."""

    children: tuple[nn.Module, ...]
    together: bool


@dataclass
class CheckpointPlan:
    """This rank's checkpointing, from the marks and the partition plan."""

    modules: dict[str, CheckpointSpec] = field(default_factory=dict)
    """Modules whose forward runs checkpointed (on their owner)."""
    sequentials: dict[str, tuple[CheckpointSpec, list[Group]]] = field(default_factory=dict)
    """Marked ``nn.Sequential`` modules that run some of their groups as one region."""

    def changes(self, name: str) -> bool:
        return name in self.sequentials or name in self.modules

    def forward_of(self, name: str, module: nn.Module) -> Callable[..., Any]:
        """The forward this rank runs for the module it owns: its own, or checkpointed."""
        forward: Callable[..., Any] = module.forward
        if name in self.sequentials:
            spec, groups = self.sequentials[name]
            forward = grouped_forward(groups, spec)
        if name in self.modules:
            forward = checkpointed(forward, self.modules[name])
        return forward


def _tree_partition(module: nn.Module, partition_of: dict[int, int]) -> int | None:
    """The partition the whole module tree runs on; None if it spans several."""
    partitions = {partition_of[id(m)] for m in module.modules()}
    return partitions.pop() if len(partitions) == 1 else None


def _one_partition_parts(name: str, module: nn.Module, partition_of: dict[int, int]) -> list[str]:
    """``name`` if its whole tree runs on one partition; else its largest subtrees that do
    (``smp.set_partition`` placed its parts apart; the automatic planner keeps it whole, or
    splits it only where a module below it is fixed): each is recomputed where it runs, and the
    module's own code between them keeps its activations."""
    if _tree_partition(module, partition_of) is not None:
        return [name]
    return [
        part
        for child_name, child in module.named_children()
        for part in _one_partition_parts(
            f"{name}.{child_name}" if name else child_name, child, partition_of
        )
    ]


def plan_checkpointing(root: nn.Module, owners: dict[str, int]) -> CheckpointPlan:
    """Resolve the marks on ``root``'s modules for the partition ``owners`` (by module name); a
    mark on a module outside ``root`` (made before ``smp.DistributedModel``) fails, naming it."""
    names = {id(m): name for name, m in root.named_modules()}
    partition_of = {id(m): owners[name] for name, m in root.named_modules()}
    with _lock:
        stray = [m for m in _unclaimed if id(m) not in names]
        _unclaimed.clear()
        marked = [(names[id(m)], m, spec) for m, spec in _marks.items() if id(m) in names]
    if stray:
        raise ModelParallelError(
            f"smp.set_activation_checkpointing was called on a {type(stray[0]).__name__} that is "
            "not part of the model given to smp.DistributedModel; pass one of its modules"
        )
    plan = CheckpointPlan()
    for name, module, spec in sorted(marked, key=lambda item: item[0]):
        one = CheckpointSpec(spec.preserve_rng_state)
        if not isinstance(module, nn.Sequential):
            plan.modules.update(
                dict.fromkeys(_one_partition_parts(name, module, partition_of), one)
            )
            continue
        children = list(module)
        partitions: list[object] = [_tree_partition(child, partition_of) for child in children]
        groups = group_runs(children, partitions, owners[name], group_size(spec.strategy))
        if any(group.together for group in groups):
            plan.sequentials[name] = (spec, groups)
        for group in groups:
            if not group.together:
                for child in group.children:
                    parts = _one_partition_parts(names[id(child)], child, partition_of)
                    plan.modules.update(dict.fromkeys(parts, one))
    return plan


def group_runs(
    children: list[nn.Module], partitions: list[object], here: object, size: int | None
) -> list[Group]:
    """SMP's grouping: runs of consecutive children on one partition, cut every ``size``
    children (``None``: never). A group on the Sequential's own partition (``here``) is one
    region; a child elsewhere is checkpointed on its own by its owner (the pipeline keeps a
    remote call's inputs and outputs there anyway, so a larger region would save nothing)."""
    runs: list[tuple[object, list[nn.Module]]] = []
    for child, partition in zip(children, partitions, strict=True):
        if runs and runs[-1][0] == partition:
            runs[-1][1].append(child)
        else:
            runs.append((partition, [child]))
    groups = []
    for partition, run in runs:
        step = size or len(run)
        for start in range(0, len(run), step):
            groups.append(Group(tuple(run[start : start + step]), partition == here))
    return groups


def _call(module: nn.Module, value: Any) -> Any:
    return module(value)


def _chain(
    children: tuple[nn.Module, ...], call: Callable[[nn.Module, Any], Any] = _call
) -> Callable[[Any], Any]:
    def through(value: Any) -> Any:
        for child in children:
            value = call(child, value)
        return value

    return through


def grouped_forward(
    groups: list[Group],
    spec: CheckpointSpec,
    alone: Callable[[nn.Module, Any], Any] = _call,
) -> Callable[[Any], Any]:
    """``nn.Sequential.forward`` that runs each ``together`` group as one checkpointed region
    and calls the other children with ``alone``."""
    regions = [
        checkpointed(_chain(g.children), spec) if g.together else _chain(g.children, alone)
        for g in groups
    ]

    def forward(value: Any) -> Any:
        for region in regions:
            value = region(value)
        return value

    return forward


# --- running checkpointed ---------------------------------------------------------------------


def _offloading() -> bool:
    """``offload_activations`` on a rank that computes on a GPU."""
    if not state.is_initialized():
        return False
    st = state.current()
    return bool(st.config["offload_activations"]) and st.device.type == "cuda"


Restorer = Callable[[], AbstractContextManager[Any]]
"""Makes a context manager that puts back a state a checkpointed call's forward ran in."""

_capturers: list[Callable[[], Restorer]] = []


def restore_on_recompute(capture: Callable[[], Restorer]) -> None:
    """Have every checkpointed call's recomputation run in a state of its forward's: ``capture``
    is called when the call runs, and what it returns wraps each recomputation (tensor
    parallelism's scaled-batch region, which has ended by then)."""
    _capturers.append(capture)


class _Recomputation(AbstractContextManager[None]):
    """The captured states, entered around a recomputation (again for each backward)."""

    def __init__(self, restorers: list[Restorer]) -> None:
        self.restorers = restorers
        self.stack = ExitStack()

    def __enter__(self) -> None:
        self.stack = ExitStack()
        for restorer in self.restorers:
            self.stack.enter_context(restorer())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        return self.stack.__exit__(exc_type, exc, traceback)


def _contexts() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """torch's ``context_fn``: nothing around the forward, the captured states around the
    recomputation."""
    return nullcontext(), _Recomputation([capture() for capture in _capturers])


def checkpointed(forward: Callable[..., Any], spec: CheckpointSpec) -> Callable[..., Any]:
    """``forward`` under torch's non-reentrant checkpointing (recomputed in backward), its
    inputs offloaded to host memory if the job says so."""
    offload = _offloading()

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is kept for backward: nothing to recompute
            return forward(*args, **kwargs)
        if offload:
            return _offloaded_call(forward, spec, args, kwargs)
        return torch.utils.checkpoint.checkpoint(
            forward,
            *args,
            use_reentrant=False,
            preserve_rng_state=spec.preserve_rng_state,
            context_fn=_contexts,
            **kwargs,
        )

    return run


class _HostCopy(NamedTuple):
    """A checkpoint's input waiting in pinned host memory for its recomputation."""

    device: torch.device
    host: torch.Tensor
    copied: torch.cuda.Event
    """Recorded after the copy to the host: the copy back waits for it, not the CPU."""


def _to_host(tensor: torch.Tensor) -> torch.Tensor | _HostCopy:
    """A tensor the checkpoint saves (one of its inputs): a GPU tensor is copied to pinned
    host memory, without waiting for the copy; the others stay as they are."""
    if tensor.device.type != "cuda" or tensor.layout != torch.strided:
        return tensor
    host = torch.empty_like(tensor, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device))
    return _HostCopy(tensor.device, host, copied)


def _to_device(saved: torch.Tensor | _HostCopy) -> torch.Tensor:
    """A saved input back where it was, for the recomputation."""
    if not isinstance(saved, _HostCopy):
        return saved
    torch.cuda.current_stream(saved.device).wait_event(saved.copied)
    return saved.host.to(saved.device, non_blocking=True)


def _offloaded_call(
    forward: Callable[..., Any],
    spec: CheckpointSpec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Checkpoint with the region's GPU inputs kept in pinned host memory: the checkpoint is
    given the inputs themselves (flattened, so that those passed by keyword are kept as it
    keeps the others), so it restores the random state of their GPU for the recomputation
    (dropout draws the same masks) and their gradients stay on the GPU; only what it saves of
    them goes to the host (saved-tensor hooks around its saving of the inputs), and comes back
    when backward's recomputation unpacks them (``activation_loading_horizon`` does not move
    that earlier, see the docs)."""
    structure, leaves = flatten((args, kwargs))

    def region(*values: torch.Tensor) -> Any:
        call_args, call_kwargs = unflatten(structure, list(values))
        return forward(*call_args, **call_kwargs)

    with torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device):
        return torch.utils.checkpoint.checkpoint(
            region,
            *leaves,
            use_reentrant=False,
            preserve_rng_state=spec.preserve_rng_state,
            context_fn=_contexts,
        )

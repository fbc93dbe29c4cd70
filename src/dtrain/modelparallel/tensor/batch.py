"""SMP's scaled batch: inside a distributed module the tensor-parallel group works on the batches
of all its ranks at once.

Without ``prescaled_batch`` every rank of a tp group brings its own batch (data sharded by
``dp_rank``). The outermost distributed module a forward enters gathers its inputs over the
group along the batch dimension, every rank computes its shard of the layers on the combined
batch, and the outputs are cut back to each rank's own rows. With ``prescaled_batch`` the
group's ranks bring the same batch (data sharded by ``rdp_rank``) and nothing is gathered.

The crossings are one collective each way: the gather is an all-gather whose backward takes
the rank's rows of the replicated gradient (no communication), the scatter takes the rank's rows
and its backward all-gathers every rank's output gradient (what DTensor's ``Shard(0)`` ↔
``Replicate()`` redistributions do, written with the collectives themselves: a redistribution
wraps and unwraps DTensors around the same collective). A parameter inside
therefore accumulates the gradient of the whole group's batch (:mod:`.shards` averages it
accordingly). Activations in the region are the same on every rank of the group, so dropout
must draw the same masks there: the outermost module runs under one seed, drawn by the group's
first rank from its own generator (at tp 1 by the process, so one process draws the masks the
group does), and sent with the shape of every rank's input, which must agree (one small
all-gather per outermost forward). The region's fork of the generators is its task's
(:mod:`..modules.generators`): while the region waits for another partition, the tasks that
compute meanwhile draw from the process's generators, so the rank's draws outside regions stay
its own. A layer checkpointed inside the region is recomputed in it too: the region's depth is
restored around the recomputation, and the checkpoint restores the generator, so the
recomputation draws the same masks.

With pipelines the region may call a module another partition owns: the request carries the
region's mark (:mod:`..modules.modes`), and there the module takes its inputs as the combined
batch they are and gives its outputs back whole; it agrees on its own group seed (that
partition's tp group runs the same requests in the same order). Their outputs come back as the
deferred values of remote calls (:class:`~..modules.unfetched.Unfetched`; a module's inputs are
fetched before it runs), which the region fetches before it cuts each rank's rows there: its
last crossing runs on its own partition after the later ones (a route back to partition 0, whose
plan gives the crossing a visit of its own there).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dtrain.dataparallel.single import all_gather_single
from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules import generators, hooks, modes
from dtrain.modelparallel.modules.activations import restore_on_recompute
from dtrain.modelparallel.modules.unfetched import materialize

T = TypeVar("T", bound=torch.Tensor | None)

_inside = threading.local()


def _all_gather(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The ranks' ``local`` tensors, concatenated along the first dimension in group order."""
    combined = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
    all_gather_single(combined, local.contiguous(), group=group)
    return combined


def _own_rows(combined: torch.Tensor, group: dist.ProcessGroup) -> slice:
    rows = combined.shape[0] // dist.get_world_size(group)
    first = dist.get_rank(group) * rows
    return slice(first, first + rows)


class _Gather(torch.autograd.Function):
    """This rank's rows → the group's. The gradient of the combined batch is the same on every
    rank of the group (the region computes on replicas), so the backward is this rank's rows of
    it, with no communication."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        combined = _all_gather(local, group)
        ctx.rows = _own_rows(combined, group)
        return combined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rows], None


class _Scatter(torch.autograd.Function):
    """The group's combined batch → this rank's rows (a copy: a view made inside a custom
    function may not be changed in place, as a module's output may be). Each rank's loss reaches
    its own rows only, so the backward all-gathers the rows' gradients into the combined one."""

    @staticmethod
    def forward(ctx: Any, combined: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return combined[_own_rows(combined, group)].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group), None


class ScaledBatch:
    """How the outermost distributed module of a forward crosses into the group's batch; every
    method is the identity when nothing is gathered (nested modules, tp 1, prescaled)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def gather(self, local: T) -> T:
        """This rank's batch → the tp group's batches, concatenated in tp-rank order."""
        if self.group is None or local is None:
            return local
        return _Gather.apply(local, self.group)

    def scatter(self, combined: T) -> T:
        """The group's combined batch (perhaps another partition's output, not yet fetched) →
        this rank's rows of it."""
        if self.group is None or combined is None:
            return combined
        return _Scatter.apply(materialize(combined), self.group)


@contextmanager
def scaled_batch(
    what: str, leading: torch.Tensor, *others: torch.Tensor | None
) -> Iterator[ScaledBatch]:
    """The region of a distributed module's forward, entered with its leading input (this
    rank's batch, whose shape every rank of the group must share) and the further inputs it
    gathers (every rank the same ones); ``what`` names the module in errors."""
    st = state.current(what)
    depth = getattr(_inside, "depth", 0)
    if depth:
        _inside.depth = depth + 1
        try:
            yield ScaledBatch(None)
        finally:
            _inside.depth = depth
        return
    seed = agree(what, leading, int(torch.randint(2**62, (1,), dtype=torch.int64).item()), others)
    # Gathered already: at tp 1, with prescaled_batch, or by a caller on another partition.
    gathered = st.tp_size == 1 or st.config["prescaled_batch"] or modes.in_tensor_region()
    devices = [st.device] if st.device.type == "cuda" else []
    _inside.depth = 1
    try:
        with generators.forked(seed, devices), modes.tensor_region():
            yield ScaledBatch(None if gathered else st.tp_process_group)
    finally:
        _inside.depth = 0


@contextmanager
def _resumed(depth: int, region: bool) -> Iterator[None]:
    saved = getattr(_inside, "depth", 0)
    _inside.depth = depth
    try:
        with modes.tensor_region(region):
            yield
    finally:
        _inside.depth = saved


def _capture() -> Callable[[], AbstractContextManager[None]]:
    """Where a checkpointed call runs, for its recomputation: a layer checkpointed inside the
    region is recomputed in backward, after the region's forward has ended; it must again see
    itself inside (nested), or it would gather the group's rows a second time. So must a layer
    that a region on another partition called (the request's mark, not the backward's)."""
    return functools.partial(_resumed, getattr(_inside, "depth", 0), modes.in_tensor_region())


restore_on_recompute(_capture)

MAX_DIMS = 4
"""Dimensions of the leading input that :func:`agree` compares (a batch's rows, sequence and
features; further ones are compared through the gather itself)."""


_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
"""Every dtype of this torch (torch names each one of them), in the order of their names: a
dtype's index is its code in :func:`agree`, its own (two dtypes sharing a code would pass the
check, then gather mismatched bytes) and the same on every rank running this torch."""


def _signature(value: torch.Tensor | None) -> list[int]:
    """What decides a further input's gather: whether it is there, its rows, its dtype."""
    if value is None:
        return [0, 0, 0]
    return [1, int(value.shape[0]) if value.dim() else -1, _DTYPES.index(value.dtype)]


def _described(signature: list[int]) -> str:
    present, rows, code = signature
    return f"{rows} rows of {_DTYPES[code]}" if present else "none"


def _fingerprint(leading: torch.Tensor) -> list[int]:
    """Two numbers that tell batches apart (its float64 sum, and its sum weighted by position,
    as their bits), for ``prescaled_batch``, where every rank of the tp group must bring the
    same batch. A batch without values (on the meta device: the automatic partition's profiled
    forward of a model created without memory, which every rank of the group runs alike) has
    none to compare: a constant, so the row keeps its length."""
    if leading.is_meta:
        return [0, 0]
    flat = leading.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device)
    sums = torch.stack([flat.sum(), flat.dot(weights)]).cpu()
    return sums.view(torch.int64).tolist()


def _check_same_batch(what: str, st: state.MPState, fingerprints: list[list[int]]) -> None:
    """With ``prescaled_batch`` the group's ranks bring one batch; other ones fail, naming
    the ranks whose differ from the first rank's and the two causes: data sharded by dp rank,
    or modules before the region computing apart (dropout from generators seeded apart)."""
    apart = [r for r, f in zip(st.tp_group, fingerprints, strict=True) if f != fingerprints[0]]
    if apart:
        raise ModelParallelError(
            f"{what}: with prescaled_batch=True every rank of tensor-parallel group "
            f"{st.tp_group} must bring the same batch, but rank(s) {apart} bring other rows "
            f"than rank {st.tp_group[0]}: shard the data by smp.rdp_rank() over "
            "smp.rdp_size(), not by smp.dp_rank(); or modules before it computed different "
            "inputs on the tp ranks, e.g. dropout drawn from generators seeded apart: seed "
            "every rank of a tp group alike"
        )


def agree(
    what: str, leading: torch.Tensor, seed: int = 0, others: tuple[torch.Tensor | None, ...] = ()
) -> int:
    """The tp group's first rank's ``seed`` (the region's, drawn by each rank from its own
    generator), after checking that every rank of the group brings ``leading`` of one shape and
    ``others`` (the further inputs the region gathers, such as a mask) alike: there or not, of
    as many rows and one dtype (with ``prescaled_batch``, ``leading`` of one content too). One
    small all-gather carries it all, so batches of different sizes fail here, naming them,
    instead of aborting a gather, and a mask one rank lacks fails instead of pairing one rank's
    gather with another's all-reduce."""
    st = state.current(what)
    if st.tp_size == 1:
        return seed
    shape = list(leading.shape[:MAX_DIMS])
    further = [number for value in others for number in _signature(value)]
    prescaled = _fingerprint(leading) if st.config["prescaled_batch"] else []
    mine = torch.tensor([seed, leading.dim(), *shape, *[0] * (MAX_DIMS - len(shape)), *further])
    rows = _all_gather(
        torch.cat([mine, torch.tensor(prescaled, dtype=torch.int64)])[None], st.object_groups["tp"]
    )
    rows, fingerprints = rows[:, : len(mine)], rows[:, len(mine) :].tolist()
    shapes = [row[2 : 2 + min(int(row[1]), MAX_DIMS)].tolist() for row in rows]
    if any(shape != shapes[0] for shape in shapes):
        given = ", ".join(f"rank {r} {s}" for r, s in zip(st.tp_group, shapes, strict=True))
        share = "the same batch" if st.config["prescaled_batch"] else "as many rows"
        raise ModelParallelError(
            f"{what}: the ranks of tensor-parallel group {st.tp_group} bring inputs of different "
            f"shapes: {given}; with prescaled_batch={st.config['prescaled_batch']} every rank of "
            f"a tp group must bring {share} (shard the data evenly, drop the last uneven batch)"
        )
    signatures = [row[2 + MAX_DIMS :].tolist() for row in rows]
    if any(signature != signatures[0] for signature in signatures):
        given = "; ".join(
            f"rank {r}: "
            + ", ".join(
                f"input {index + 1} {_described(signature[3 * index : 3 * index + 3])}"
                for index in range(len(others))
            )
            for r, signature in zip(st.tp_group, signatures, strict=True)
        )
        raise ModelParallelError(
            f"{what}: the ranks of tensor-parallel group {st.tp_group} bring different further "
            f"inputs: {given}; every rank of a tp group must bring the same ones (a mask on "
            "each rank or on none), of as many rows and one dtype"
        )
    if prescaled:
        _check_same_batch(what, st, fingerprints)
    return int(rows[0][0].item())


def check_batch(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of ``DistributedLinear`` and ``DistributedEmbedding``, whose exchange
    of the ranks' rows needs equal shapes: different ones fail naming them. Their input comes
    first or as ``input=``, which moves to the front: torch's parallel styles' hooks, after
    this one, read the first positional argument."""
    if not args and "input" in kwargs:
        kwargs = dict(kwargs)
        args = (kwargs.pop("input"),)
    if args and isinstance(args[0], torch.Tensor):
        agree(f"smp.nn.{type(module).__name__}", args[0])
    return args, kwargs


def check_batches(module: nn.Module) -> None:
    """Run :func:`check_batch` before each forward of ``module``, where the module computes (a
    collective of its tp group: never on a rank that calls it on another partition)."""
    handle = module.register_forward_pre_hook(check_batch, prepend=True, with_kwargs=True)
    hooks.run_where_computed(module, {handle.id})

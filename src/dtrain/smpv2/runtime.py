"""SMP v2's process-wide state: ``tsm.init()`` and ``tsm.state``.

``init`` merges the script's config under the job's parameters (``SM_HP_MP_PARAMETERS``, which
``dtrain run`` sets from the distribution's ``modelparallel`` parameters, as SageMaker does),
validates them, joins the job's world unless the script did (AWS's scripts call
``dist.init_process_group`` first), lays the ranks out (:mod:`dtrain.smpv2.layout`) and makes
every group once, every rank making every group in the same order, as torch requires:

* a DeviceMesh over the grid ``(replicate, hybrid_shard, tp)``: FSDP's mesh is its first two
  dimensions (``state.mesh("replicate", "hybrid_shard")``: hybrid sharding, whose shard groups
  are the layout's shard x cp lines), DTensor's tensor-parallel mesh its last
  (``state.mesh("tp")``); one root, as FSDP needs to shard parameters that are DTensors on the
  tp mesh already;
* the context-parallel groups, which lie inside the hybrid shard dimension (``cp_process_group``).

``init`` also sets glibc's heap to return large freed blocks to the system
(:mod:`dtrain.modelparallel.heap`), as ``smp.init`` does for sharded data parallelism: the
script's FSDP gathers each unit's parameters and frees them at every use, and with glibc's
rising threshold the heaps kept what was freed (``benchmarks/smp_v2_memory.py --layers 12``:
each hybrid shard 2 rank peaked 546 MiB higher, and held 833 MiB more after its steps).

The mesh's dimension names are new at every ``init`` (``replicate0``...; ``state.mesh`` takes the
kinds): DTensor caches its sharding decisions by spec, and specs compare meshes by layout and
names, not by process group, so an equal mesh made after :func:`shutdown` would otherwise get
tensors placed on the destroyed groups of the first one.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtrain.config.schema import coerce, job_parameters, warn_overridden
from dtrain.config.smpv2 import (
    SPECS,
    hybrid_shard_extent,
    runs_native_fsdp,
    validate_smp_v2_parameters,
)
from dtrain.dataparallel import process_group
from dtrain.errors import ConfigError, DtrainError
from dtrain.modelparallel import heap
from dtrain.smpv2.bindings import modules_holding_torch_fsdp
from dtrain.smpv2.layout import GroupKind, Layout
from dtrain.smpv2.rng import MODEL_PARALLEL_RNG, RngStateTracker

ENV_PARAMETERS = "SM_HP_MP_PARAMETERS"
"""Where SageMaker (and ``dtrain run``) put the job's model-parallel parameters, as JSON."""

WHERE = "mp_parameters"
"""How errors name the merged parameters (``mp_parameters.hybrid_shard_degree: got 3; ...``)."""

MESH_KINDS: tuple[GroupKind, ...] = ("replicate", "hybrid_shard", "tp")
"""The dimensions of ``state.mesh``, outermost first."""


class NotInitializedError(DtrainError):
    """``tsm.state`` was read before ``tsm.init()``."""


@dataclass(frozen=True)
class Running:
    """Everything ``tsm.init`` decided for this process; ``tsm.state`` reads it."""

    config: dict[str, Any]
    """The parameters as merged and validated (``hybrid_shard_degree`` as given)."""
    layout: Layout
    hybrid_shard_degree: int
    """Ranks per shard group, resolved: 0 only when the script's FSDP runs as torch has it
    (given 0 without tensor or context parallelism)."""
    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    cp_rank: int
    cp_size: int
    ep_rank: int
    ep_size: int
    rep_rank: int
    """Which replica of its shard this rank holds (its index in its replication group)."""
    rep_size: int
    dp_rank: int
    """Which batch this rank reads: ``rank // (tp * cp)``, as AWS's scripts compute it."""
    dp_size: int
    world_process_group: dist.ProcessGroup
    tp_process_group: dist.ProcessGroup
    cp_process_group: dist.ProcessGroup
    rep_rank_process_group: dist.ProcessGroup
    device_mesh: DeviceMesh = field(repr=False)
    mesh_names: dict[str, str]
    rng: RngStateTracker = field(repr=False)
    owns_world: bool = field(repr=False)
    """Whether ``init`` created the default group (then :func:`shutdown` destroys it)."""
    created_groups: tuple[dist.ProcessGroup, ...] = field(repr=False)

    @property
    def ranker(self) -> Layout:
        """SMP's name for the layout (``get_rep_rank``, ``get_rep_groups``)."""
        return self.layout


_READABLE = frozenset({f.name for f in fields(Running)} | {"ranker"} | set(SPECS))


class State:
    """``tsm.state``: the running configuration, ranks and groups, read as attributes.

    Before ``tsm.init()`` a script may set a parameter (AWS's scripts set the degrees to 1 when
    they run without SMP's implementation), which then counts as the script's config; reading
    anything else fails naming it. After ``init`` the state is read-only: setting a parameter to
    another value than the one running fails, since the groups are made.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_running", None)
        object.__setattr__(self, "_assigned", {})

    _running: Running | None
    _assigned: dict[str, Any]

    def _current(self, what: str) -> Running:
        if self._running is None:
            raise NotInitializedError(f"tsm.state.{what}: call tsm.init() first")
        return self._running

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in _READABLE:
            raise AttributeError(f"tsm.state has no attribute {name!r}")
        if self._running is None and name in self._assigned:
            return self._assigned[name]
        running = self._current(name)
        return getattr(running, name) if hasattr(running, name) else running.config[name]

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in SPECS:
            raise AttributeError(
                f"tsm.state.{name} cannot be set; the script may set SMP v2's parameters "
                f"before tsm.init(): {', '.join(SPECS)}"
            )
        checked = coerce(SPECS[name], value, f"tsm.state.{name}")
        if self._running is None:
            self._assigned[name] = checked
        elif self._running.config[name] != checked:
            raise ConfigError(
                f"tsm.state.{name}",
                value,
                f"{self._running.config[name]!r}, the value running since tsm.init(): set "
                "parameters before tsm.init()",
            )

    def get_rng_state_tracker(self) -> RngStateTracker:
        """The named random streams of tensor-parallel code (:mod:`dtrain.smpv2.rng`)."""
        return self._current("get_rng_state_tracker()").rng

    def mesh(self, *kinds: str) -> DeviceMesh:
        """The DeviceMesh over the dimensions ``kinds`` (of :data:`MESH_KINDS`, in order):
        ``mesh("replicate", "hybrid_shard")`` for FSDP, ``mesh("tp")`` for DTensor."""
        running = self._current("mesh()")
        unknown = [kind for kind in kinds if kind not in MESH_KINDS]
        if unknown or not kinds:
            raise ValueError(f"mesh dimensions {kinds}: give some of {MESH_KINDS}")
        names = tuple(running.mesh_names[kind] for kind in kinds)
        return running.device_mesh[names[0] if len(names) == 1 else names]


state = State()
_MESHES = itertools.count()
"""Numbers the meshes this process makes (see the module's docstring)."""


def init(config: Mapping[str, Any] | None = None) -> None:
    """Start SMP v2 (``tsm.init``); every rank of the job calls it, after
    ``dist.init_process_group`` or instead of it.

    ``config`` and the job's parameters are merged; where both set a parameter differently,
    the job's value wins, with a warning naming both. A later call changes nothing: it warns,
    or fails if ``config`` asks for something other than what runs.
    """
    script = _script_config(config or {})
    if state._running is not None:
        _check_running(script, state._running)
        return
    job = job_parameters(ENV_PARAMETERS, "SMP v2 parameters")
    warn_overridden(script, job, "tsm.init", WHERE, ENV_PARAMETERS, stacklevel=2)
    parameters = {**script, **job}
    # Checked before joining the world, so a typo fails at once on every rank.
    values = validate_smp_v2_parameters(parameters, where=WHERE)
    heap.prepare(keep_freed_blocks=False)  # FSDP gathers and frees each unit at every use
    owns_world = _join_world()
    try:
        running = _build(values, owns_world)
    except BaseException:
        if owns_world:
            dist.destroy_process_group()
        raise
    object.__setattr__(state, "_running", running)
    state._assigned.clear()
    early = modules_holding_torch_fsdp() if running.hybrid_shard_degree else []
    if early:
        warnings.warn(
            f"tsm.init: {', '.join(early)} imported torch's FullyShardedDataParallel or "
            "fully_shard before torch.sagemaker: an FSDP built through those names shards as "
            f"torch's does, not over hybrid_shard_degree {running.hybrid_shard_degree} "
            f"(tensor_parallel_degree {running.tp_size}); import torch.sagemaker first, or "
            'pass tsm.state.mesh("replicate", "hybrid_shard") to FSDP',
            stacklevel=2,
        )


def is_initialized() -> bool:
    return state._running is not None


def shutdown() -> None:
    """Destroy the groups ``init`` made (the world too if it made it) and forget the state, so
    that ``init`` can start over (tests do)."""
    running = state._running
    object.__setattr__(state, "_running", None)
    state._assigned.clear()
    if running is None:
        return
    for group in running.created_groups:
        dist.destroy_process_group(group)
    if running.owns_world:
        dist.destroy_process_group()


def _script_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters the script set on ``tsm.state`` and those it passes to ``init``; a
    parameter given both ways must agree."""
    assigned = state._assigned
    for name in sorted(assigned.keys() & config.keys()):
        if config[name] != assigned[name]:
            raise ConfigError(
                f"tsm.init.{name}",
                config[name],
                f"{assigned[name]!r}, the value the script set on tsm.state.{name}: give one",
            )
    return {**assigned, **config}


def _check_running(script: Mapping[str, Any], running: Running) -> None:
    """A late ``init(config)``: it cannot change what runs, so it must agree."""
    checked = validate_smp_v2_parameters(script, where=WHERE)
    for name in script:
        if checked[name] != running.config[name]:
            raise ConfigError(
                f"{WHERE}.{name}",
                script[name],
                f"{running.config[name]!r}, the value running already: call tsm.init(config) "
                "once, before anything else uses torch.sagemaker",
            )
    warnings.warn("tsm.init: already initialized, ignoring this call", stacklevel=3)


def _join_world() -> bool:
    """Join the job's world unless the script already did; True if we created it. Launched
    (``RANK`` set: dtrain run, torchrun), from the launcher's variables; else a world of one."""
    if dist.is_initialized():
        return False
    if process_group.is_available():
        process_group.init_process_group()
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def _device_type() -> str:
    """Where the world's collectives run: CUDA unless its backend is gloo (smddp is NCCL on a
    CUDA machine, gloo elsewhere)."""
    return "cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu"


def _my_groups(
    layout: Layout, kinds: tuple[GroupKind, ...], me: int
) -> dict[str, dist.ProcessGroup]:
    """This rank's group of each kind. Every rank makes every group, in one order; groups with
    the same members are made once."""
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    mine: dict[str, dist.ProcessGroup] = {}
    for kind in kinds:
        for members in layout.groups(kind):
            key = tuple(members)
            if key not in made:
                group = dist.new_group(members)
                assert group is not None
                made[key] = group
            if me in members:
                mine[kind] = made[key]
    return mine


def _build(values: dict[str, Any], owns_world: bool) -> Running:
    me, world = dist.get_rank(), dist.get_world_size()
    layout = Layout.of(values, world, WHERE)
    groups = _my_groups(layout, (*MESH_KINDS, "cp"), me)
    device_type = _device_type()
    local_rank = process_group.get_local_rank()
    if device_type == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    number = next(_MESHES)
    names: dict[str, str] = {kind: f"{kind}{number}" for kind in MESH_KINDS}
    shape = layout.shape
    grid = torch.arange(world).reshape(
        shape["replicate"], shape["shard"] * shape["cp"], shape["tp"]
    )
    mesh = DeviceMesh.from_group(
        [groups[kind] for kind in MESH_KINDS],
        device_type,
        mesh=grid,
        mesh_dim_names=tuple(names.values()),
    )
    coords = layout.coords(me)
    rng = RngStateTracker(device_type)
    rng.add(MODEL_PARALLEL_RNG, int(values["random_seed"]) + coords["tp"])
    native = runs_native_fsdp(values)
    return Running(
        config=values,
        layout=layout,
        hybrid_shard_degree=0 if native else hybrid_shard_extent(values, world),
        rank=me,
        world_size=world,
        local_rank=local_rank,
        tp_rank=coords["tp"],
        tp_size=shape["tp"],
        cp_rank=coords["cp"],
        cp_size=shape["cp"],
        ep_rank=0,
        ep_size=1,
        rep_rank=coords["replicate"],
        rep_size=shape["replicate"],
        dp_rank=layout.index("data", me),
        dp_size=shape["replicate"] * shape["shard"],
        world_process_group=dist.group.WORLD,  # type: ignore[arg-type]  # set once joined
        tp_process_group=groups["tp"],
        cp_process_group=groups["cp"],
        rep_rank_process_group=groups["replicate"],
        device_mesh=mesh,
        mesh_names=names,
        rng=rng,
        owns_world=owns_world,
        created_groups=tuple({id(group): group for group in groups.values()}.values()),
    )

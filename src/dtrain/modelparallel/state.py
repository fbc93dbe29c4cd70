"""The model-parallel runtime's process-wide state: config, rank layout and process groups.

``init`` (``smp.init``) joins the job's torch.distributed world (or uses the one the script made),
lays the ranks out with :class:`dtrain.topology.Topology` and creates every group SMP v1 exposes,
so the rest of the runtime asks :func:`current` instead of recomputing ranks.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtrain.config.modelparallel import (
    MP_PARAMETER_ALIASES,
    check_world_size,
    validate_mp_parameters,
)
from dtrain.config.schema import job_parameters, warn_overridden
from dtrain.dataparallel import process_group
from dtrain.errors import ConfigError
from dtrain.modelparallel import heap
from dtrain.modelparallel.errors import (
    ModelParallelError,
    MultipleDistributedModelError,
    NotInitializedError,
)
from dtrain.modelparallel.options import RuntimeOptions
from dtrain.sealed import Seals, job_key
from dtrain.topology import GroupKind, Topology

ENV_PARAMETERS = "SM_HP_MP_PARAMETERS"
"""Where SageMaker (and ``dtrain run``) put the job's model-parallel parameters, as JSON."""

WHERE = "mp_parameters"
"""How errors name the merged parameters (``mp_parameters.microbatches: got 0; ...``)."""

GROUP_KINDS: tuple[GroupKind, ...] = ("pp", "dp", "mp", "tp", "rdp")

RECEIVE_LIMIT = 7 * 24 * 3600.0
"""Timeout of the pipeline's messaging groups, where a receiver always waits for its peer's
next message: a pipeline may rest between steps (a checkpoint upload, an evaluation outside
steps) for longer than any wait for a reply may last. A dead peer ends the receive at once;
waits for replies and step ends have their own ``DTRAIN_MP_TIMEOUT``."""


@dataclass(frozen=True)
class MPState:
    """Everything ``smp.init`` decided for this process; read-only for the rest of the runtime.

    ``*_group`` are sorted global ranks; ``*_rank`` is this rank's index in them (what
    ``torch.distributed`` reports as the group rank). ``object_groups`` are gloo groups of the
    same members (keys ``world`` and :data:`GROUP_KINDS`) for pickled objects, so object
    messaging works whatever the world's backend.
    """

    config: dict[str, Any]
    topology: Topology
    rank: int
    size: int
    local_rank: int
    local_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    mp_rank: int
    mp_size: int
    tp_rank: int
    tp_size: int
    rdp_rank: int
    rdp_size: int
    pp_group: list[int]
    dp_group: list[int]
    mp_group: list[int]
    tp_group: list[int]
    rdp_group: list[int]
    world_process_group: dist.ProcessGroup
    pp_process_group: dist.ProcessGroup
    dp_process_group: dist.ProcessGroup
    mp_process_group: dist.ProcessGroup
    tp_process_group: dist.ProcessGroup
    rdp_process_group: dist.ProcessGroup
    pp_message_group: dist.ProcessGroup
    """gloo group of the pipeline for every message of the runtime, tensors included (even on
    an NCCL world: see :mod:`.transport.wire`)."""
    object_groups: dict[str, dist.ProcessGroup] = field(repr=False)
    device: torch.device
    options: RuntimeOptions
    seals: Seals = field(repr=False)
    """The job's key and this rank's counts of sealed objects (:mod:`dtrain.sealed`)."""
    owns_world: bool = field(repr=False)
    """Whether ``init`` created the default group (then ``shutdown`` destroys it)."""
    created_groups: tuple[dist.ProcessGroup, ...] = field(repr=False)
    sharding_mesh: DeviceMesh | None = field(default=None, repr=False)
    """With ``sharded_data_parallel_degree`` above 1, FSDP2's mesh over this rank's rdp group
    (its data-parallel group without tensor parallelism): its last dimension is a group of
    that many neighbouring replicas, which shard; a first one (when the degree is below the rdp
    degree) the ranks holding the same shard in the other groups, which replicate (MiCS,
    FSDP2's HSDP). See :func:`sharding_grid`."""
    tensor_mesh: DeviceMesh | None = field(default=None, repr=False)
    """With ``tensor_parallel_degree`` above 1, DTensor's one-dimensional mesh over this rank's
    tensor-parallel group, on which the ``smp.nn`` modules shard their parameters; with sharded
    data parallelism too, sliced from the same mesh as :attr:`sharding_mesh`."""


_state: MPState | None = None
_auto_init = False
_model: Any = None
_optimizer: Any = None
_on_reset: list[Callable[[], None]] = []


# --- lifecycle -------------------------------------------------------------------------------


def init(config: Mapping[str, Any] | None = None) -> None:
    """Start the model-parallel runtime (``smp.init``); every rank of the job must call it.

    ``config`` and the job's parameters (``SM_HP_MP_PARAMETERS``, set by SageMaker and
    ``dtrain run``) are merged; where both set a parameter differently, the job's value wins,
    with a warning naming both. A call after the runtime started changes nothing: it warns, or
    fails if ``config`` asks for something else than what runs.
    """
    global _state, _auto_init
    if _state is not None:
        _check_running(config or {}, _state)
        return
    _auto_init = False
    parameters = _merge(config or {}, job_parameters(ENV_PARAMETERS, "model-parallel parameters"))
    # Checked before joining the world, so a typo fails at once on every rank.
    values = validate_mp_parameters(parameters, where=WHERE)
    heap.prepare(keeps_freed_blocks(values))  # before the world's threads allocate
    options = RuntimeOptions.from_environment()
    owns_world = _join_world(options.timeout, visible_gpus())
    try:
        check_world_size(values, dist.get_world_size(), WHERE)
        _state = _build(values, options, owns_world)
    except BaseException:
        if owns_world:
            dist.destroy_process_group()
        raise


def keeps_freed_blocks(values: Mapping[str, Any]) -> bool:
    """Whether a rank keeps the large blocks it frees for reuse (:mod:`.heap`): a pipeline
    planned for speed; one planned for memory, or sharded data parallelism (which gathers and
    frees parameters at every use), returns them."""
    return bool(values["pipeline_parallel_degree"] > 1 and values["optimize"] == "speed")


def request_auto_init() -> None:
    """Start the runtime at its first use, unless ``smp.init(config)`` comes first.

    SMP starts itself when ``smdistributed.modelparallel.torch`` is imported inside a job, so a
    script's own ``smp.init(config)`` after the import was ignored; deferring the start to the
    first call that needs it lets that config count.
    """
    global _auto_init
    _auto_init = True


def is_initialized() -> bool:
    if _state is None and _auto_init:
        init()
    return _state is not None


def current(what: str = "this call") -> MPState:
    """The runtime's state; raises :class:`NotInitializedError` naming ``what`` before init."""
    if _state is None and _auto_init:
        init()
    if _state is None:
        raise NotInitializedError(what)
    return _state


def reset() -> None:
    """Forget the model, optimizer and manual placements (``smp.reset``), keeping the groups.

    Closes the model's pipeline runtime, so every rank of the pipeline must call it.
    """
    global _model, _optimizer
    model, _model, _optimizer = _model, None, None
    close = getattr(model, "close", None)
    if callable(close):
        close()
    for forget in _on_reset:
        forget()


def on_reset(forget: Callable[[], None]) -> None:
    """Run ``forget`` at every reset: for modules above this one that keep per-job state
    (manual placements); they import this module, so it cannot import them."""
    _on_reset.append(forget)


def shutdown() -> None:
    """Reset, then destroy the groups ``init`` created (the world too if it made it)."""
    global _state, _auto_init
    _auto_init = False
    if _state is None:
        return
    reset()
    st, _state = _state, None
    for group in st.created_groups:
        dist.destroy_process_group(group)
    if st.owns_world:
        dist.destroy_process_group()


# --- the one model per process ---------------------------------------------------------------


def register_model(model: Any) -> None:
    """Record the process's ``DistributedModel``; SMP allows exactly one per script."""
    global _model
    current("smp.DistributedModel")
    if _model is not None and _model is not model:
        raise MultipleDistributedModelError(
            "only one smp.DistributedModel per script is supported; call smp.reset() to start "
            "over with a new one"
        )
    _model = model


def current_model() -> Any:
    """The registered ``DistributedModel``, or None."""
    return _model


def register_optimizer(optimizer: Any) -> None:
    """Record the ``DistributedOptimizer`` that ``resume_from_checkpoint`` loads into."""
    global _optimizer
    current("smp.DistributedOptimizer")
    _optimizer = optimizer


def current_optimizer() -> Any:
    """The registered ``DistributedOptimizer``, or None."""
    return _optimizer


def num_microbatches() -> int:
    return int(current("smp.num_microbatches()").config["microbatches"])


# --- ranks and groups (SMP v1 names) ---------------------------------------------------------


def rank() -> int:
    return current("smp.rank()").rank


def size() -> int:
    return current("smp.size()").size


def local_rank() -> int:
    return current("smp.local_rank()").local_rank


def local_size() -> int:
    return current("smp.local_size()").local_size


def mp_rank() -> int:
    return current("smp.mp_rank()").mp_rank


def mp_size() -> int:
    return current("smp.mp_size()").mp_size


def dp_rank() -> int:
    return current("smp.dp_rank()").dp_rank


def dp_size() -> int:
    return current("smp.dp_size()").dp_size


def pp_rank() -> int:
    return current("smp.pp_rank()").pp_rank


def pp_size() -> int:
    return current("smp.pp_size()").pp_size


def tp_rank() -> int:
    return current("smp.tp_rank()").tp_rank


def tp_size() -> int:
    return current("smp.tp_size()").tp_size


def rdp_rank() -> int:
    return current("smp.rdp_rank()").rdp_rank


def rdp_size() -> int:
    return current("smp.rdp_size()").rdp_size


def get_mp_group() -> list[int]:
    return list(current("smp.get_mp_group()").mp_group)


def get_dp_group() -> list[int]:
    return list(current("smp.get_dp_group()").dp_group)


def get_pp_group() -> list[int]:
    return list(current("smp.get_pp_group()").pp_group)


def get_tp_group() -> list[int]:
    return list(current("smp.get_tp_group()").tp_group)


def get_rdp_group() -> list[int]:
    return list(current("smp.get_rdp_group()").rdp_group)


def get_world_process_group() -> dist.ProcessGroup:
    return current("smp.get_world_process_group()").world_process_group


def get_mp_process_group() -> dist.ProcessGroup:
    return current("smp.get_mp_process_group()").mp_process_group


def get_dp_process_group() -> dist.ProcessGroup:
    return current("smp.get_dp_process_group()").dp_process_group


def get_pp_process_group() -> dist.ProcessGroup:
    return current("smp.get_pp_process_group()").pp_process_group


def get_tp_process_group() -> dist.ProcessGroup:
    return current("smp.get_tp_process_group()").tp_process_group


def get_rdp_process_group() -> dist.ProcessGroup:
    return current("smp.get_rdp_process_group()").rdp_process_group


# --- helpers of init -------------------------------------------------------------------------


def _canonical(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters under their schema names (``partitions`` is ``pipeline_parallel_degree``)."""
    return {MP_PARAMETER_ALIASES.get(key, key): value for key, value in parameters.items()}


def _merge(config: Mapping[str, Any], env: Mapping[str, Any]) -> dict[str, Any]:
    """The script's ``config`` under the job's parameters: where both set one differently, the
    job's value wins, with a warning naming it (as on SageMaker, where the job's parameters
    override the defaults a script passes to ``smp.init``)."""
    warn_overridden(
        _canonical(config), _canonical(env), "smp.init", WHERE, ENV_PARAMETERS, stacklevel=3
    )
    merged = dict(config)
    for key, value in env.items():  # the job's spelling of a parameter replaces the script's
        name = MP_PARAMETER_ALIASES.get(key, key)
        for spelling in (name, *(a for a, n in MP_PARAMETER_ALIASES.items() if n == name)):
            merged.pop(spelling, None)
        merged[key] = value
    return merged


def _check_running(config: Mapping[str, Any], running: MPState) -> None:
    """A late ``smp.init(config)``: it cannot change the running runtime, so it must agree."""
    validate_mp_parameters(config, where=WHERE)
    for name, value in _canonical(config).items():
        if running.config[name] != value:
            raise ConfigError(
                f"{WHERE}.{name}",
                value,
                f"{running.config[name]!r}, the value the runtime already runs with: call "
                "smp.init(config) before anything else uses smp",
            )
    warnings.warn(
        "smp.init: the model-parallel runtime is already initialized, ignoring this call",
        stacklevel=3,
    )


def _join_world(timeout: float, gpus: int) -> bool:
    """Join the job's world unless the script already did; True if we created it.

    Launched by ``dtrain run``, torchrun or mpirun, the environment names the rendezvous; a
    script started on its own becomes a world of one process. The backend is the one
    :func:`rank_device` chooses for ``gpus`` GPUs and this host's processes.
    """
    if dist.is_initialized():
        return False
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout)}
    host = 1
    if any(os.environ.get(name) for name in ("RANK", "OMPI_COMM_WORLD_RANK")):
        host = _launched_local_size()
    else:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    backend, _ = rank_device(gpus, 0, host, None)
    process_group.init_process_group(backend, **kwargs)
    return True


def _launched_local_size() -> int:
    """Processes on this host, from the launcher's environment: what
    ``process_group.get_local_size`` says once the world exists."""
    for name in (
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_SIZE",
    ):
        value = os.environ.get(name)
        if value:
            return int(value)
    return 1


def visible_gpus() -> int:
    """CUDA devices this process may use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(
    gpus: int, local_rank: int, local_size: int, backend: str | None
) -> tuple[str, torch.device]:
    """The world's backend and the device this rank computes on.

    ``gpus`` is how many CUDA devices the process sees (0 without CUDA), ``local_size`` how
    many processes its host runs, ``backend`` the backend of the world the script made, or None
    when ``smp.init`` makes it. The rule:

    * Without GPUs every rank computes on the CPU.
    * With GPUs every rank computes on one, ``cuda:(local_rank % gpus)``, whatever the world's
      backend: SMP always trained on GPUs, and a script that wants the CPU on a GPU machine
      hides them (``CUDA_VISIBLE_DEVICES=``). Ranks share GPUs when the host runs more
      processes than it has GPUs (pp=2 on one GPU).
    * The world ``smp.init`` makes is NCCL when each process of the host has a GPU of its own,
      else gloo: NCCL refuses two ranks on one GPU, and nothing needs it there (the pipeline's
      messages always go over gloo, and gloo reduces CUDA tensors too, as broadcasts and
      gradient averaging need). A world the script made on NCCL with more processes per host
      than GPUs fails here, saying so, rather than later inside NCCL.
    """
    if gpus == 0:
        return backend or "gloo", torch.device("cpu")
    shared = local_size > gpus
    if backend is None:
        backend = "gloo" if shared else "nccl"
    elif shared and "nccl" in backend:
        raise ModelParallelError(
            f"the world's backend is {backend!r}, which needs a GPU per process, but this host "
            f"runs {local_size} processes on {gpus} GPU(s): run at most {gpus} per host, or let "
            "smp.init create the world (it uses gloo when processes share GPUs)"
        )
    return backend, torch.device("cuda", local_rank % gpus)


class _GroupMaker:
    """Creates process groups as torch requires: every rank creates every group, in one order.

    Groups with the same backend and members are created once and shared, unless ``fresh``.
    """

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = timedelta(seconds=timeout)
        self.created: list[dist.ProcessGroup] = []
        self._shared: dict[tuple[str, tuple[int, ...]], Any] = {}  # non-members get a marker

    def mine(
        self, groups: list[list[int]], backend: str, fresh: bool = False, idle: bool = False
    ) -> dist.ProcessGroup:
        """This rank's group among ``groups`` (which partition the world); an ``idle`` group's
        receives may wait without limit (:data:`RECEIVE_LIMIT`)."""
        timeout = timedelta(seconds=RECEIVE_LIMIT) if idle else self.timeout
        found: dist.ProcessGroup | None = None
        for members in groups:
            key = (backend, tuple(members))
            group = None if fresh else self._shared.get(key)
            if group is None:
                group = dist.new_group(members, timeout=timeout, backend=backend)
                self._shared.setdefault(key, group)
                if self.rank in members:
                    self.created.append(group)
            if self.rank in members:
                found = group
        assert found is not None, f"rank {self.rank} is in none of {groups}"
        return found


def _build(values: dict[str, Any], options: RuntimeOptions, owns_world: bool) -> MPState:
    me, world = dist.get_rank(), dist.get_world_size()
    topology = Topology(
        world,
        process_group.get_local_size(),
        values["pipeline_parallel_degree"],
        values["tensor_parallel_degree"],
        values["placement_strategy"],
    )
    coords = topology.coords(me)
    local = process_group.get_local_rank()
    backend = str(dist.get_backend())
    _, device = rank_device(visible_gpus(), local, topology.processes_per_host, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the main thread's; pool and receiver threads set theirs
    maker = _GroupMaker(me, options.timeout)
    groups = {kind: maker.mine(topology.all_groups(kind), backend) for kind in GROUP_KINDS}
    objects: dict[str, dist.ProcessGroup] = {
        kind: maker.mine(topology.all_groups(kind), "gloo") for kind in GROUP_KINDS
    }
    objects["world"] = maker.mine([list(range(world))], "gloo")
    pipelines = topology.all_groups("pp")
    messaging = maker.mine(pipelines, "gloo", fresh=True, idle=True)
    sharding_mesh = tensor_mesh = None
    if values["sharded_data_parallel_degree"] > 1:
        sharding_mesh, tensor_mesh = _sharding_meshes(
            maker, topology, values["sharded_data_parallel_degree"], backend, device.type
        )
    elif topology.tensor_degree > 1:
        name = f"tp{next(_MESHES)}"  # new names for every mesh: see _sharding_meshes
        tensor_mesh = DeviceMesh.from_group(groups["tp"], device.type, mesh_dim_names=(name,))
    members = {kind: topology.group(kind, me) for kind in GROUP_KINDS}
    return MPState(
        config=values,
        topology=topology,
        rank=me,
        size=world,
        local_rank=local,
        local_size=topology.processes_per_host,
        pp_rank=coords.pp_rank,
        pp_size=topology.pipeline_degree,
        dp_rank=coords.dp_rank,
        dp_size=topology.dp_degree,
        mp_rank=coords.mp_rank,
        mp_size=topology.mp_degree,
        tp_rank=coords.tp_rank,
        tp_size=topology.tensor_degree,
        rdp_rank=coords.rdp_rank,
        rdp_size=topology.rdp_degree,
        pp_group=members["pp"],
        dp_group=members["dp"],
        mp_group=members["mp"],
        tp_group=members["tp"],
        rdp_group=members["rdp"],
        world_process_group=dist.distributed_c10d._get_default_group(),
        pp_process_group=groups["pp"],
        dp_process_group=groups["dp"],
        mp_process_group=groups["mp"],
        tp_process_group=groups["tp"],
        rdp_process_group=groups["rdp"],
        pp_message_group=messaging,
        object_groups=objects,
        device=device,
        options=options,
        seals=Seals(job_key(), me),
        owns_world=owns_world,
        created_groups=tuple(maker.created),
        sharding_mesh=sharding_mesh,
        tensor_mesh=tensor_mesh,
    )


_MESHES = itertools.count()
"""Numbers the sharding meshes this process makes (see :func:`_sharding_mesh`)."""


def sharding_grid(topology: Topology, degree: int) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The world's ranks as the grid of sharded data parallelism at degree ``degree``
    (``pipeline_parallel_degree`` 1), and its dimensions' kinds: ``replicate`` (when the degree
    is below the rdp degree), ``shard`` and ``tp`` (above tensor degree 1).

    ``grid[r, s, t]`` is the rank at tp rank ``t`` and rdp rank ``r * degree + s``: each rdp
    group (the replicas of one tp slice) is cut into groups of ``degree`` consecutive replicas,
    which shard; replicas at the same place in those groups replicate (HSDP). Lines along a
    dimension are groups of the placement's layout (a ``tp`` line is a tp group), whatever the
    placement strategy."""
    tp, rdp = topology.tensor_degree, topology.rdp_degree
    grid = torch.tensor(
        [
            [[topology.rank_of(0, t, r * degree + s) for t in range(tp)] for s in range(degree)]
            for r in range(rdp // degree)
        ]
    )
    kinds = ("replicate", "shard", "tp")
    kept = [d for d, size in enumerate(grid.shape) if size > 1 or kinds[d] == "shard"]
    return grid.reshape([grid.shape[d] for d in kept]), tuple(kinds[d] for d in kept)


def _sharding_meshes(
    maker: _GroupMaker, topology: Topology, degree: int, backend: str, device_type: str
) -> tuple[DeviceMesh, DeviceMesh | None]:
    """FSDP2's mesh for ``sharded_data_parallel_degree`` ``degree`` and, above tensor degree
    1, DTensor's tp mesh: both sliced from one mesh over :func:`sharding_grid`, as FSDP2 needs
    to shard a parameter that is a DTensor on the tp mesh already (it concatenates the two
    meshes, which must share their root).

    The dimensions' names are new for every mesh: torch's DTensor caches its sharding
    decisions by spec, and specs compare meshes by layout and names, not by process group, so
    an equal mesh made after ``smp.shutdown`` would get tensors on the destroyed groups of
    the first one."""
    n = next(_MESHES)
    grid, kinds = sharding_grid(topology, degree)
    groups = [
        maker.mine(grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist(), backend)
        for d in range(grid.ndim)
    ]
    names = tuple(f"{kind}{n}" for kind in kinds)
    root = DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=names)
    sharding = tuple(name for name, kind in zip(names, kinds, strict=True) if kind != "tp")
    if "tp" not in kinds:
        return root, None
    return root[sharding], root[names[-1]]

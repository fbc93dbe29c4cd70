"""Training that stops, checkpoints and resumes, as AWS's SMP v2 scripts do it (their
``train_lib.py``'s step and ``checkpoints.py``'s save and load, each kind through
``torch.sagemaker``'s API), against one process: tiny Hugging Face Llama (:mod:`.fsdp_cases`).

Each step clips the gradients with ``torch.sagemaker.grad_norm.clip_grad_norm_`` (a norm small
enough to clip every step) before AdamW's step and a learning-rate schedule's, so resuming must
restore the weights, AdamW's moments and step, and the schedule. :func:`train_runs` runs each
:class:`Run` in turn on every rank of one world: ``tsm.init``, the model (split by
``tsm.transform`` for tensor parallelism) wrapped in FSDP, a resume from a checkpoint of one
kind, steps ``start`` to ``STEPS`` of the global batches, the saves after ``SAVED_AT`` steps;
and the losses, the norms ``clip_grad_norm_`` returned, the whole parameters. The asynchronous
saves are finished only after the last step, while training went on.

Kinds, as AWS's ``--checkpoint_type``: ``sharded`` (``SHARDED_STATE_DICT``, ``save`` by the
first replica's shard groups, one folder per tp rank), ``async_sharded`` (the same through
``async_save``), ``async_local`` (``SM_LOCAL_STATE_DICT`` through ``async_save`` over each
replication group, one folder per shard); to resume only, ``v1_full`` (an SMP v1 full
checkpoint, :func:`v1_full_checkpoint`); to save only, ``over_world`` (a mistake, refused).
"""

from __future__ import annotations

import torch.sagemaker as tsm  # before torch.distributed.fsdp's names, as AWS's scripts do

# isort: split
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import (
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
from torch.sagemaker.distributed.checkpoint.state_dict_saver import async_save, save
from torch.sagemaker.distributed.checkpoint.state_dict_utils import (
    SMStateDictType,
    init_optim_state,
    sm_state_dict_type,
)
from torch.sagemaker.grad_norm import clip_grad_norm_
from torch.sagemaker.utils.process_group_utils import get_global_ranks

from dtrain.smpv2 import shutdown
from tests.modelparallel.harness import single_process
from tests.smpv2.fsdp_cases import GLOBAL_BATCH, Trained, batch, build, full_parameters, shard

STEPS = 3
SAVED_AT = 2
LR = 1e-2
EPS = 1e-6
"""AdamW's: with torch's 1e-8, the tiny gradients of embedding rows divided by their tiny second
moments amplify float32's rounding to 2e-4 in the parameters (measured: the one-process recipe
in float32 against float64); 1e-6 keeps it at 4e-6."""
WEIGHT_DECAY = 0.01
GAMMA = 0.7
MAX_NORM = 0.5
"""Below every step's gradient norm (0.8 and more here): every step clips."""


def _optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)


def reference(
    family: str, first: int = 0, weights: dict[str, Tensor] | None = None, steps: int = STEPS
) -> Trained:
    """One process, the whole batch each step, torch's ``clip_grad_norm_``: steps ``first`` to
    ``steps`` from the family's weights, or from ``weights`` with a new optimizer."""
    model = build(family)
    if weights is not None:
        model.load_state_dict(weights)
    optimizer, schedule = _optimizer(model)
    losses, norms = [], []
    for step in range(first, steps):
        optimizer.zero_grad()
        loss = model(**batch(step)).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Trained(losses, params, {"norms": norms})


@dataclass(frozen=True)
class Run:
    parameters: dict[str, Any]
    """The SMP v2 parameters given to ``tsm.init``."""
    family: str = "llama"
    tensor_parallel: bool = False
    fsdp: str = "fsdp1"
    """``fsdp1`` (``use_orig_params=True``, as AWS's scripts with SMP's implementation),
    ``fsdp1_flat`` (``use_orig_params=False``) or ``fsdp2`` (``fully_shard``)."""
    resume: tuple[str, str] | None = None
    """(kind, folder under the root): start from that checkpoint, at step ``SAVED_AT``."""
    saves: tuple[tuple[str, str], ...] = ()
    """(kind, folder under the root): checkpoints written after ``SAVED_AT`` steps."""
    full: str | None = None
    """A folder under the root for the whole model in HF's format after the last step
    (``pytorch_model.bin`` and ``config.json``, AWS's ``save_final_model``)."""
    steps: int = STEPS


@dataclass
class Resumed(Trained):
    norms: list[float] = field(default_factory=list)
    loaded: dict[str, Any] = field(default_factory=dict)
    """What the resume read beside the model and optimizer (AWS's ``total_steps``)."""
    refusals: list[str] = field(default_factory=list)


def train_runs(runs: list[Run], root: str) -> list[Resumed | None]:
    """On every rank, each run in turn (see the module); rank 0 returns the results."""
    dist.init_process_group("gloo")
    results: list[Resumed | None] = []
    for run in runs:
        tsm.init(run.parameters)
        try:
            result = _run(run, Path(root))
        finally:
            shutdown()
        results.append(result if dist.get_rank() == 0 else None)
    dist.destroy_process_group()
    return results


def _run(run: Run, root: Path) -> Resumed:
    model = _wrapped(run)
    optimizer, schedule = _optimizer(model)
    queue = AsyncCallsQueue()
    share = GLOBAL_BATCH // tsm.state.dp_size
    mine = slice(tsm.state.dp_rank * share, (tsm.state.dp_rank + 1) * share)
    result = Resumed([], {})
    start = 0
    if run.resume is not None:
        kind, folder = run.resume
        result.loaded = LOADS[kind](model, optimizer, schedule, root / folder)
        start = SAVED_AT
    for step in range(start, run.steps):
        optimizer.zero_grad()
        loss = model(**{k: v[mine] for k, v in batch(step).items()}).loss
        loss.backward()
        result.norms.append(clip_grad_norm_(model, MAX_NORM).item())
        optimizer.step()
        schedule.step()
        mean = loss.detach()
        dist.all_reduce(mean)
        result.losses.append(mean.item() / dist.get_world_size())
        if step + 1 == SAVED_AT:
            for kind, folder in run.saves:
                SAVES[kind](model, optimizer, schedule, root / folder, queue)
    queue.close()  # finishes the asynchronous saves, begun while training went on
    result.refusals, REFUSALS[:] = list(REFUSALS), []
    if run.full is not None:
        _save_full(model, root / run.full)
    result.params = full_parameters(model, run.fsdp.removesuffix("_flat"))
    return result


def _wrapped(run: Run) -> nn.Module:
    model = build(run.family)
    if run.tensor_parallel:
        model = tsm.transform(model)
    fsdp = "fsdp2" if run.fsdp == "fsdp2" else "fsdp1"
    options = {} if fsdp == "fsdp2" else {"use_orig_params": run.fsdp == "fsdp1"}
    return shard(model, run.family, fsdp, **options)


def _user_content(model: nn.Module) -> dict[str, Any]:
    """What AWS's scripts add to a checkpoint beside the model (a config object among it)."""
    config = model.module.config if isinstance(model, FSDP) else model.config
    return {"total_steps": SAVED_AT, "model_config": config, "cli_args": {"lr": LR}}


def _sharded_folder(folder: Path) -> Path:
    tp = tsm.state.tensor_parallel_degree
    return folder / f"tp{tp}-{tsm.state.tp_rank}" if tp > 1 else folder


def _save_sharded(
    model: nn.Module, optimizer: Any, schedule: Any, folder: Path, queue: AsyncCallsQueue, *,
    background: bool,
) -> None:  # fmt: skip
    group = model.process_group
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {
            "model": model.state_dict(),
            "optimizer": FSDP.optim_state_dict(model, optimizer),
            "scheduler": schedule.state_dict(),
            **_user_content(model),
        }
    if tsm.state.ranker.get_rep_rank(dist.get_rank()) != 0:
        return  # the first replica's shard groups save
    options = {
        "checkpoint_id": _sharded_folder(folder),
        "process_group": group,
        "coordinator_rank": min(get_global_ranks(group)),
    }
    if background:
        async_save(state, queue=queue, **options)
    else:
        save(state, **options)


def _load_sharded(model: nn.Module, optimizer: Any, schedule: Any, folder: Path) -> dict[str, Any]:
    """AWS's load, but for the optimizer: its state is loaded into FSDP's own sharded optimizer
    state dict (torch's ``load_sharded_optimizer_state_dict``, which AWS's scripts call, takes
    no ``process_group`` in stock torch and splits DTensors over the world)."""
    group = model.process_group
    options = {"process_group": group, "coordinator_rank": min(get_global_ranks(group))}
    reader = DistributedFileSystemReader(_sharded_folder(folder))
    optim_config = ShardedOptimStateDictConfig(offload_to_cpu=True)
    with FSDP.state_dict_type(
        model, StateDictType.SHARDED_STATE_DICT, optim_state_dict_config=optim_config
    ):
        state = {"model": model.state_dict(), "scheduler": schedule.state_dict(), "total_steps": 0}
        load(state, storage_reader=reader, **options)
        model.load_state_dict(state["model"])
        schedule.load_state_dict(state["scheduler"])
        init_optim_state(optimizer, skip_empty_param=True)
        optim = {"optimizer": FSDP.optim_state_dict(model, optimizer)}
        load(optim, storage_reader=DistributedFileSystemReader(_sharded_folder(folder)), **options)
        flat = FSDP.optim_state_dict_to_load(
            model=model, optim=optimizer, optim_state_dict=optim["optimizer"]
        )
        optimizer.load_state_dict(flat)
    return {"total_steps": state["total_steps"]}


def _local_folder(model: nn.Module, folder: Path) -> Path:
    return folder / f"tp{tsm.state.tp_rank}_ep{tsm.state.ep_rank}_fsdp{model.rank}"


def _save_local(
    model: nn.Module, optimizer: Any, schedule: Any, folder: Path, queue: AsyncCallsQueue
) -> None:
    group = tsm.state.rep_rank_process_group
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": schedule.state_dict(),
            **_user_content(model),
        }
    async_save(
        state,
        checkpoint_id=_local_folder(model, folder),
        process_group=group,
        coordinator_rank=min(get_global_ranks(group)),
        queue=queue,
    )


def _load_local(model: nn.Module, optimizer: Any, schedule: Any, folder: Path) -> dict[str, Any]:
    group = tsm.state.rep_rank_process_group
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state = {"model": model.state_dict(), "scheduler": schedule.state_dict(), "total_steps": 0}
        init_optim_state(optimizer, skip_empty_param=True)
        state["optimizer"] = optimizer.state_dict()
        load(
            state,
            process_group=group,
            coordinator_rank=min(get_global_ranks(group)),
            storage_reader=DistributedFileSystemReader(_local_folder(model, folder)),
        )
    optimizer.load_state_dict(state["optimizer"])  # its learning rates: the state is in place
    schedule.load_state_dict(state["scheduler"])
    return {"total_steps": state["total_steps"]}


def _save_full(model: nn.Module, folder: Path) -> None:
    """AWS's full checkpoint: rank 0 writes HF's ``pytorch_model.bin`` and config."""
    config = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / "pytorch_model.bin")
        model.module.config.save_pretrained(folder)
    dist.barrier()


def _load_v1_full(model: nn.Module, optimizer: Any, schedule: Any, file: Path) -> dict[str, Any]:
    """AWS's upgrade path: SMP v1's full checkpoint (whole tensors, HF's names) loaded into the
    transformed model under FSDP as a full state dict; the optimizer and schedule start anew."""
    whole = torch.load(file, map_location="cpu", weights_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(whole)
    return {"keys": len(whole)}


def _save_over_world(
    model: nn.Module, optimizer: Any, schedule: Any, folder: Path, queue: AsyncCallsQueue
) -> None:
    """A mistake: the sharded state saved by every rank into one folder, where each tp rank's
    slices share names. Refused; the refusal is kept in ``REFUSALS``."""
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
    try:
        save(state, checkpoint_id=folder)
    except CheckpointException as error:
        REFUSALS.append(str(error))


REFUSALS: list[str] = []

SAVES = {
    "over_world": _save_over_world,
    "sharded": functools.partial(_save_sharded, background=False),
    "async_sharded": functools.partial(_save_sharded, background=True),
    "async_local": _save_local,
}
LOADS = {
    "sharded": _load_sharded,
    "async_sharded": _load_sharded,
    "async_local": _load_local,
    "v1_full": _load_v1_full,
}


def v1_full_checkpoint(file: Path) -> dict[str, Tensor]:
    """In this process: SMP v1 (dtrain's) trains the family's model for ``SAVED_AT`` SGD steps
    and saves it whole (``smp.save_checkpoint(partial=False)``: HF's names, whole tensors at
    any degree) as ``file``; its full state dict."""
    import dtrain.modelparallel as smp

    with single_process():
        model = smp.DistributedModel(build("llama"))
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        @smp.step
        def train_step(model: smp.DistributedModel, ids: Tensor) -> Any:
            loss = model(input_ids=ids, labels=ids).loss
            model.backward(loss)
            return loss

        for step in range(SAVED_AT):
            optimizer.zero_grad()
            train_step(model, batch(step)["input_ids"])
            optimizer.step()
        smp.save_checkpoint(str(file.parent), file.name, partial=False, model=model)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

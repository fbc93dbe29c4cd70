"""Saving and loading a partitioned model: ``smp.save``/``load`` and SMP's checkpoint folders.

A *partial* checkpoint keeps each pipeline partition's own state in its own file, written by
the partition's dp rank 0 and read back by every rank holding that partition, so it needs the
same ``pipeline_parallel_degree`` to load. A *full* checkpoint is the whole model's state dict
(gathered from every partition) in one file written by rank 0; like SMP, it holds no optimizer
state. Layout under ``path``::

    {tag}_partial/model_{pp}_{tp}_{rdp}.pt      partial model state (``local_state_dict``)
    {tag}_partial/optimizer_{pp}_{tp}_{rdp}.pt  partial optimizer state
    {tag}_partial/fp16_states_{pp}_{tp}_{rdp}.pt  fp32 master weights and loss scale (fp16/bf16)
    {tag}_partial/user_content.pt               whatever the script passed as user_content
    {tag}                                       full model state dict
    user_content_{tag}                          user_content of a full checkpoint
    newest                                      the tag of the newest checkpoint

The model and optimizer only need ``local_state_dict()``, ``state_dict()`` (full; every rank
calls it) and ``load_state_dict(...)``.

Loading never unpickles code: files are read with ``torch.load(weights_only=True)``, which admits
tensors, containers and plain values, all that dtrain's own checkpoint files hold, and, in
``user_content`` and ``smp.load`` files, numpy's scalars and arrays of plain dtypes and Hugging
Face configs, rebuilt from the file's values (AWS's GPT-2 script saves a numpy parameter count
and its ``GPT2Config``; at most a config's constructor runs). A planted file cannot run code of
its own (:mod:`dtrain.script_values`). ``user_content`` and ``smp.load`` files holding objects of
the script's own classes need ``weights_only=False``, the caller's explicit trust in the file.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dtrain.modelparallel import state
from dtrain.modelparallel.api import comm
from dtrain.modelparallel.api.model import DistributedModel
from dtrain.modelparallel.api.precision import FP16_STATES
from dtrain.modelparallel.api.state_dicts import DEGREES_KEY, check_degrees
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.state import MPState
from dtrain.modelparallel.tensor import translated
from dtrain.script_values import read_script_values
from dtrain.sealed import broadcast_object

NEWEST = "newest"
PARTIAL_SUFFIX = "_partial"
USER_CONTENT = "user_content.pt"


def _part_path(f: str | os.PathLike[str], st: MPState) -> str:
    return f"{os.fspath(f)}_{st.pp_rank}_{st.tp_rank}.pt"


def _check_parts(f: str, st: MPState) -> None:
    """A partial file must exist for this rank, and exactly one per model-parallel rank."""
    base = Path(f)
    pattern = re.compile(re.escape(base.name) + r"_\d+_\d+\.pt")
    names = [p.name for p in base.parent.iterdir()] if base.parent.is_dir() else []
    parts = sorted(name for name in names if pattern.fullmatch(name))
    if len(parts) != st.mp_size or not Path(_part_path(f, st)).exists():
        raise ModelParallelError(
            f"smp.load: found {len(parts)} partial files for {f} ({', '.join(parts) or 'none'}) "
            f"but this job has {st.mp_size} model-parallel ranks (pipeline_parallel_degree "
            f"{st.pp_size} x tensor_parallel_degree {st.tp_size}); partial checkpoints load "
            "only with the degrees they were saved with; save a full one (partial=False) to "
            "change them"
        )


def save(obj: Any, f: str | os.PathLike[str], partial: bool = True) -> None:
    """``torch.save`` for model-parallel scripts (``smp.save``).

    ``partial``: each caller writes its own part, ``{f}_{pp_rank}_{tp_rank}.pt`` (call it on
    ``rdp_rank() == 0``: one caller per model-parallel rank); otherwise only rank 0 writes
    ``f``.
    """
    st = state.current("smp.save")
    if partial:
        torch.save(obj, _part_path(f, st))
    elif st.rank == 0:
        torch.save(obj, os.fspath(f))


def load(
    f: str | os.PathLike[str],
    partial: bool = True,
    map_location: Any = None,
    weights_only: bool = True,
) -> Any:
    """``torch.load`` for model-parallel scripts (``smp.load``): ``partial`` reads this rank's part.

    ``weights_only=True`` (the default; SMP's was False) refuses to unpickle anything but
    tensors, containers, plain values, numpy's plain scalars and arrays and Hugging Face configs;
    pass False only for a file you trust.
    """
    st = state.current("smp.load")
    path = os.fspath(f)
    if partial:
        _check_parts(path, st)
        path = _part_path(path, st)
    return read_script_values(Path(path), weights_only, map_location)


def _valid_tag(tag: object, where: str = "checkpoint tag") -> str:
    """``tag`` if it names a file right under the checkpoint folder: a tag read from a
    ``newest`` file or given by a caller must not lead anywhere else."""
    if not isinstance(tag, str) or tag in ("", ".", "..") or "/" in tag or not tag.isprintable():
        raise ValueError(
            f"{where} must be a non-empty string without '/' or control characters, other "
            f"than '.' and '..', got {tag!r}"
        )
    return tag


def _check_tag(tag: object) -> str:
    tag = _valid_tag(tag)
    tags = comm.allgather(tag, comm.WORLD)
    if len(set(tags)) != 1:
        raise ModelParallelError(f"every rank must save the same checkpoint tag, got {tags}")
    return tag


def _rank_file(kind: str, st: MPState, rdp_rank: int) -> str:
    return f"{kind}_{st.pp_rank}_{st.tp_rank}_{rdp_rank}.pt"


def _share(st: MPState, kind: str) -> tuple[bool, int]:
    """Whether this rank writes partial files of ``kind``, and the index (``rdp``) of those it
    writes and reads: one writer per pipeline stage (its dp rank 0); with sharded data
    parallelism one per shard (the first shard group's ranks), whose file the ranks holding
    the same shard read; with ``shard_optimizer_state`` every rank its optimizer state, by its
    rdp rank (ZeRO shards over the rdp group). With tensor parallelism one per tp rank of each
    stage (its rdp rank 0; without it the rdp rank is the dp rank)."""
    if kind == "optimizer" and st.config["shard_optimizer_state"]:
        return True, st.rdp_rank
    degree = st.config["sharded_data_parallel_degree"]
    return st.rdp_rank < degree, st.rdp_rank % degree


OPTIMIZER_SHARDS_KEY = "_dtrain_optimizer_shards"
"""In a partial optimizer file: :func:`optimizer_shards` when it was saved. Files saved before
it was recorded lack it; their names gave the dp rank, not the rdp rank, with
``shard_optimizer_state``, which differ only with tensor parallelism."""


def optimizer_shards(st: MPState) -> int:
    """Into how many parts the optimizer state of one pipeline stage and tp rank is split over
    its replicas: ``sharded_data_parallel_degree``, or with ``shard_optimizer_state`` the rdp
    degree (ZeRO shards over the rdp group); 1 when each rank holds it whole."""
    if st.config["shard_optimizer_state"]:
        return st.rdp_size
    return st.config["sharded_data_parallel_degree"]


def _shards_named(count: int) -> str:
    return "whole" if count == 1 else f"in {count} shards"


def save_checkpoint(
    path: str | os.PathLike[str],
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> None:
    """Save a checkpoint under ``path`` (``smp.save_checkpoint``); every rank must call it.

    ``translate_if_full``: a full checkpoint names the parameters of modules translated from
    Hugging Face models (GPT-2, GPT-J, GPT-NeoX made SMP's ``DistributedTransformerLMHead``) as
    the HF model does, so it loads into the plain model; False keeps SMP's names.
    ``num_kept_partial_checkpoints`` removes the oldest partial checkpoints beyond that many.
    On return the checkpoint is complete on every rank and ``path/newest`` names it.
    """
    st = state.current("smp.save_checkpoint")
    if num_kept_partial_checkpoints is not None and num_kept_partial_checkpoints < 1:
        raise ValueError(
            f"num_kept_partial_checkpoints must be at least 1, got {num_kept_partial_checkpoints}"
        )
    tag = _check_tag(tag)
    root = Path(path)
    if partial:
        folder = root / f"{tag}{PARTIAL_SUFFIX}"
        if st.rank == 0:
            _empty(folder)
        comm.barrier()
        writes, index = _share(st, "model")
        if writes and model is not None:
            torch.save(model.local_state_dict(), folder / _rank_file("model", st, index))
        writes, index = _share(st, "optimizer")
        if writes and optimizer is not None:
            optimizer_state = optimizer.local_state_dict()
            optimizer_state[OPTIMIZER_SHARDS_KEY] = optimizer_shards(st)
            if FP16_STATES in optimizer_state:
                fp16_file = folder / _rank_file(FP16_STATES, st, index)
                torch.save(optimizer_state.pop(FP16_STATES), fp16_file)
            torch.save(optimizer_state, folder / _rank_file("optimizer", st, index))
        if st.rank == 0 and user_content is not None:
            torch.save(user_content, folder / USER_CONTENT)
    else:
        if optimizer is not None and st.rank == 0:
            warnings.warn(
                "smp.save_checkpoint(partial=False) saves the model only, not the optimizer "
                "state; use partial=True to resume training",
                stacklevel=2,
            )
        model_state = model.state_dict() if model is not None else None
        if st.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if model_state is not None:
                if translate_if_full and isinstance(model, DistributedModel):
                    model_state = translated.to_hf(model.get_module(), model_state)
                torch.save(model_state, root / tag)
            if user_content is not None:
                torch.save(user_content, root / f"user_content_{tag}")
    comm.barrier()
    if st.rank == 0:
        _write_newest(root, tag)
        if partial and num_kept_partial_checkpoints is not None:
            _prune(root, tag, num_kept_partial_checkpoints)
    comm.barrier()


def _empty(folder: Path) -> None:
    """Make ``folder`` an empty folder: a file left by an earlier save of the tag (at other
    degrees) would be loaded by a rank it matches."""
    if folder.is_dir():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def _write_newest(root: Path, tag: str) -> None:
    scratch = root / f".{NEWEST}.tmp"
    scratch.write_text(tag)
    os.replace(scratch, root / NEWEST)


def _prune(root: Path, tag: str, keep: int) -> None:
    """Remove the oldest (by modification time) partial checkpoints, never the one just saved."""
    others = [
        p
        for p in root.glob(f"*{PARTIAL_SUFFIX}")
        if p.is_dir() and p.name != f"{tag}{PARTIAL_SUFFIX}"
    ]
    others.sort(key=lambda p: (p.stat().st_mtime_ns, p.name))
    for old in others[: max(0, len(others) - (keep - 1))]:
        shutil.rmtree(old)


def newest_tag(path: str | os.PathLike[str]) -> str:
    """The tag ``save_checkpoint`` last wrote under ``path``."""
    marker = Path(path) / NEWEST
    if not marker.is_file():
        raise FileNotFoundError(
            f"no checkpoint under {path}: {marker} does not exist; pass tag= to choose one"
        )
    return _valid_tag(marker.read_text().strip(), f"the tag in {marker}")


def resume_from_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    weights_only: bool = True,
) -> Any:
    """Load a checkpoint into the ``DistributedModel`` (and optimizer); returns user_content.

    ``tag=None`` loads the newest. Every rank loads its own partition's part (partial) or the
    whole state (full); the model applies it once it is partitioned. A full state with Hugging
    Face's names for a module translated from an HF model is renamed to SMP's;
    ``translate_function`` (full only) instead turns the state into the model's names, for
    models dtrain does not translate. ``load_sharded_optimizer_state=False`` (sharded data
    parallelism only) loads the fp16 states (the loss scaler) and the param groups' options, not
    the parameters' optimizer state.
    Model and optimizer state are always read as weights only; ``weights_only=False`` trusts
    ``user_content`` to hold objects of the script's own classes.
    """
    st = state.current("smp.resume_from_checkpoint")
    model = state.current_model()
    if model is None:
        raise ModelParallelError(
            "smp.resume_from_checkpoint loads into the model: create smp.DistributedModel first"
        )
    sharded = st.config["sharded_data_parallel_degree"] > 1
    _check_resume_options(partial, sharded, load_sharded_optimizer_state, translate_function)
    root = Path(path)
    tag = newest_tag(root) if tag is None else _valid_tag(tag)
    if partial:
        folder = root / f"{tag}{PARTIAL_SUFFIX}"
        _check_saved_degrees(folder, st)
        model_file = folder / _rank_file("model", st, _share(st, "model")[1])
        _, index = _share(st, "optimizer")
        optimizer_file = folder / _rank_file("optimizer", st, index)
        optimizer_state = _saved_files(folder, model_file, optimizer_file, load_optimizer, st)
        model.load_state_dict(_read(model_file), strict=strict)
        if optimizer_state is not None:
            optimizer = state.current_optimizer()
            if optimizer is None:
                warnings.warn(
                    "the checkpoint has optimizer state but there is no smp.DistributedOptimizer "
                    "to load it into; create it before resume_from_checkpoint",
                    stacklevel=2,
                )
            else:
                optimizer_state.pop(OPTIMIZER_SHARDS_KEY, None)
                if not load_sharded_optimizer_state:  # the groups' options, no state
                    optimizer_state = {**optimizer_state, "state": {}}
                fp16_file = folder / _rank_file(FP16_STATES, st, index)
                if fp16_file.is_file():
                    optimizer_state[FP16_STATES] = _read(fp16_file)
                optimizer.load_state_dict(optimizer_state)
        user_file = folder / USER_CONTENT
    else:
        values = _read(root / tag)
        if translate_function is not None:
            values = _translated_by(translate_function, values, model, strict)
        model.load_state_dict(values, strict=strict)
        user_file = root / f"user_content_{tag}"
    return read_script_values(user_file, weights_only) if user_file.is_file() else None


def _check_resume_options(
    partial: bool,
    sharded: bool,
    load_sharded_optimizer_state: bool,
    translate_function: Callable[[dict[str, Any]], dict[str, Any]] | None,
) -> None:
    """Options that would otherwise be ignored fail, naming what they need."""
    if not load_sharded_optimizer_state and not partial:
        raise ValueError(
            "smp.resume_from_checkpoint: load_sharded_optimizer_state=False applies to partial "
            "checkpoints (partial=True); a full one holds no optimizer state"
        )
    if not load_sharded_optimizer_state and not sharded:
        raise ValueError(
            "smp.resume_from_checkpoint: load_sharded_optimizer_state=False applies to sharded "
            "data parallelism only (sharded_data_parallel_degree above 1); without it, use "
            "load_optimizer=False to skip the optimizer's state"
        )
    if translate_function is not None and (partial or not callable(translate_function)):
        raise ValueError(
            "smp.resume_from_checkpoint: translate_function must be a function of a full "
            f"state dict (partial=False), got {translate_function!r} with partial={partial}"
        )


def _translated_by(
    translate_function: Callable[[dict[str, Any]], dict[str, Any]],
    values: dict[str, Any],
    model: Any,
    strict: bool,
) -> dict[str, Any]:
    """``translate_function(values)``, which must be a state dict; with ``strict``, of exactly the
    ``DistributedModel``'s keys: others fail here, naming them and the function."""
    result = translate_function(values)
    if not isinstance(result, dict):
        raise TypeError(
            f"smp.resume_from_checkpoint: translate_function {translate_function!r} returned "
            f"{type(result).__name__}; allowed: a state dict (dict)"
        )
    if not strict or not isinstance(model, DistributedModel):  # its load_state_dict judges
        return result
    known = translated.state_keys(model.get_module())
    unexpected = sorted(set(result) - known)
    missing = sorted(known - set(result))
    if unexpected or missing:
        raise ModelParallelError(
            f"smp.resume_from_checkpoint: translate_function {translate_function!r} returned "
            f"keys the model does not have: {unexpected}; missing the model's keys: {missing}"
        )
    return result


def _check_saved_degrees(folder: Path, st: MPState) -> None:
    """The degrees a partial checkpoint was saved at must be this job's, on every rank alike
    before anything loads: rank 0 reads them from its model file (a partial state names them)
    and tells the others. Not inferred from the file names: a rank may see only its node's
    files, or files another save left."""
    saved = None
    if st.rank == 0:
        model_file = folder / _rank_file("model", st, _share(st, "model")[1])
        if model_file.is_file():
            saved = torch.load(model_file, "cpu", weights_only=True, mmap=True).get(DEGREES_KEY)
    saved = broadcast_object(saved, 0, st.object_groups["world"], st.seals)
    if saved is not None:
        check_degrees(saved, st, f"smp.resume_from_checkpoint({folder})")


def _saved_files(
    folder: Path, model_file: Path, optimizer_file: Path, load_optimizer: bool, st: MPState
) -> Any:
    """The optimizer state to load from the partial checkpoint in ``folder`` (this rank's
    ``optimizer_file``, read once), or None (``load_optimizer`` false, or none saved), agreed
    by every rank in one all-gather with whether each rank finds its ``model_file``: a rank
    without its model file fails every rank, naming each missing file and its rank (failing
    alone, it would leave the others waiting in the all-gather); all ranks find their
    optimizer files, split as this job splits the state, or none does (a checkpoint of the
    model only). A rank without its file while others have theirs, or a state split otherwise
    (another rdp degree with ``shard_optimizer_state``), fails on every rank, naming them: the
    optimizer would start afresh on some ranks."""
    saved, shards = None, None
    if load_optimizer and optimizer_file.is_file():
        saved = _read(optimizer_file)
        shards = saved.get(OPTIMIZER_SHARDS_KEY, 0) if isinstance(saved, dict) else 0
    lacking = None if model_file.is_file() else model_file.name
    gathered = comm.allgather((lacking, shards), comm.WORLD)
    what = f"smp.resume_from_checkpoint({folder})"
    absent = {rank: name for rank, (name, _) in enumerate(gathered) if name is not None}
    if absent:
        files = ", ".join(sorted(set(absent.values())))
        raise FileNotFoundError(
            f"{what}: ranks {list(absent)} find no model file of theirs ({files} does not "
            "exist; not a partial checkpoint?)"
        )
    if not load_optimizer:
        return None
    found = [count for _, count in gathered]
    here = optimizer_shards(st)
    missing = [rank for rank, count in enumerate(found) if count is None]
    if len(missing) == len(found):
        return None
    if missing:
        raise ModelParallelError(
            f"{what}: ranks {missing} find no optimizer state of theirs (each reads "
            "optimizer_{pp_rank}_{tp_rank}_{rdp_rank}.pt), the other ranks do: it was saved "
            f"split otherwise (this job holds it {_shards_named(here)}); resume with the "
            "shard_optimizer_state and rdp degree it was saved with, or with "
            "load_optimizer=False to start the optimizer afresh"
        )
    old = here > 1 and st.tp_size > 1 and st.config["shard_optimizer_state"]
    for rank, count in enumerate(found):
        if count != here and (count != 0 or old):
            saved_as = "by an older dtrain" if count == 0 else _shards_named(count)
            raise ModelParallelError(
                f"{what}: the optimizer state of rank {rank} was saved {saved_as}, this job "
                f"holds it {_shards_named(here)} (shard_optimizer_state "
                f"{st.config['shard_optimizer_state']}, rdp degree {st.rdp_size}); allowed: the "
                "same split; resume with the shard_optimizer_state and rdp degree it was saved "
                "with, or with load_optimizer=False to start the optimizer afresh"
            )
    return saved


def _read(file: Path) -> Any:
    """dtrain's own files: tensors, containers and plain values only."""
    return torch.load(file, map_location="cpu", weights_only=True)

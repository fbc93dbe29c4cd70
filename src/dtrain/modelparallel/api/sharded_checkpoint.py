"""``smp.sharded_data_parallel_checkpoint``: a sharded model's partial checkpoint put back
together as the whole model's state dict, without a job.

AWS's sharded scripts point to ``get_full_state_dict_from_sharded_data_parallel_checkpoint``
for this. Their own ``sharded_data_parallel_checkpoint.py`` reads DeepSpeed's layout (a
``model_0.pt`` and flat fp32 groups in the optimizer files), which dtrain's checkpoints do not
have; this one reads dtrain's: ``{tag}_partial/model_0_{tp}_{rdp}.pt``, one file per shard of
each tp slice, each holding its rank's pieces of the parameters and where each lies in its
whole tensor (:data:`.state_dicts.PIECES_KEY`), and the buffers whole.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dtrain.modelparallel.api.checkpoint import PARTIAL_SUFFIX, newest_tag
from dtrain.modelparallel.api.state_dicts import METADATA_KEYS, PIECES_KEY
from dtrain.modelparallel.errors import ModelParallelError

SMP_PREFIX = "module."
"""What SMP's state dicts put before every name (dtrain's have none)."""

WHAT = "get_full_state_dict_from_sharded_data_parallel_checkpoint"


def get_full_state_dict_from_sharded_data_parallel_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    tag: str | None = None,
    remove_smp_prefix: bool = True,
) -> dict[str, torch.Tensor]:
    """The whole model's state dict from the partial checkpoint ``tag`` (default: the newest)
    that a sharded model (``sharded_data_parallel_degree`` above 1) saved under
    ``checkpoint_dir``, its floating tensors in ``dtype``, on the CPU; the arguments of AWS's
    function. A model translated from Hugging Face keeps SMP's names, as its partial files do
    (``smp.nn.huggingface.*.translate_state_dict_to_hf_*`` renames them)."""
    root = Path(checkpoint_dir)
    tag = newest_tag(root) if tag is None else tag
    folder = root / (tag if tag.endswith(PARTIAL_SUFFIX) else f"{tag}{PARTIAL_SUFFIX}")
    files = sorted(folder.glob("model_*_*_*.pt"))
    if not files:
        raise FileNotFoundError(
            f"{WHAT}: no partial model files (model_*_*_*.pt) in {folder}: not a partial checkpoint"
        )
    whole: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for file in files:
        saved = torch.load(file, map_location="cpu", weights_only=True)
        if PIECES_KEY not in saved:
            raise ModelParallelError(
                f"{WHAT}: {file} does not say where its tensors lie in the whole ones: it was "
                "not saved by a sharded model (sharded_data_parallel_degree above 1); load it "
                "at the degrees it was saved at and take model.state_dict()"
            )
        for name, value in saved.items():
            if name in METADATA_KEYS:
                continue
            if name not in saved[PIECES_KEY]:  # whole in every file
                whole.setdefault(name, value)
                continue
            shape, start = saved[PIECES_KEY][name]
            if name not in whole:
                whole[name], filled[name] = value.new_empty(shape), 0
            place = whole[name]
            for dim, (begin, length) in enumerate(zip(start, value.shape, strict=True)):
                place = place.narrow(dim, begin, length)
            place.copy_(value)
            filled[name] += value.numel()
    for name, count in filled.items():
        if count != whole[name].numel():
            raise ModelParallelError(
                f"{WHAT}: the pieces of {name!r} in {folder} hold {count} of its "
                f"{whole[name].numel()} elements: the files of some ranks are missing (each "
                "rank of the first shard group writes one per tp rank)"
            )
    return {
        _named(name, remove_smp_prefix): value.to(dtype) if value.is_floating_point() else value
        for name, value in whole.items()
    }


def _named(name: str, remove_smp_prefix: bool) -> str:
    return name[len(SMP_PREFIX) :] if remove_smp_prefix and name.startswith(SMP_PREFIX) else name

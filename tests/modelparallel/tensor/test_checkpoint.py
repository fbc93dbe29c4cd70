"""Checkpoints across tensor-parallel degrees: a full checkpoint saved at tp=1 loads at tp=2 and
one saved at tp=2 loads at tp=1 and into the plain model, with the same values; a partial one
saved at one degree fails at the other naming both, through smp.resume_from_checkpoint and
through model.load_state_dict of its file (SMP's rule: partial checkpoints need the degrees
they were saved at)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from tests.modelparallel.harness import run_ranks, single_process
from tests.modelparallel.tensor.test_equivalence import (
    _batch,
    _lm,
    _lm_loss,
    _optimizer,
    step_of,
)

PP1 = "pipeline_parallel_degree 1"


def _refusal(tp_saved: int, tp_here: int, folder: Path | None = None) -> str:
    what = "load_state_dict" if folder is None else f"smp.resume_from_checkpoint({folder})"
    return (
        f"{what}: the partial state was saved at {PP1} x tensor_parallel_degree {tp_saved}, "
        f"this job runs at {PP1} x tensor_parallel_degree {tp_here}; allowed: the same "
        "degrees (a partial state holds one partition's tensors, split over its tp group); "
        "save a full one (partial=False) to load it at other degrees"
    )


def _trained_and_saved(root: str, tag: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """An LM model after one step on this rank's rows, saved whole and partially under ``tag``."""
    model = smp.DistributedModel(_lm())
    optimizer = smp.DistributedOptimizer(_optimizer(model.parameters()))
    train_step = step_of(_lm_loss)
    ids, mask = _batch(smp.tp_size())
    rows = len(ids) // smp.dp_size()
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    optimizer.zero_grad()
    train_step(model, ids[mine], mask[mine])
    optimizer.step()
    smp.save_checkpoint(root, f"{tag}_part", model=model, optimizer=optimizer)
    smp.save_checkpoint(root, f"{tag}_whole", partial=False, model=model)
    return model, model.state_dict()


def _resumed(root: str, tag: str) -> dict[str, torch.Tensor]:
    smp.reset()
    model = smp.DistributedModel(_lm())
    smp.resume_from_checkpoint(root, tag=tag, partial=False)
    return model.state_dict()


def _refused(action: Any) -> str:
    with pytest.raises(ModelParallelError) as caught:
        action()
    return str(caught.value)


def _at_tp2(root: str) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    out: dict[str, Any] = {"loaded": _resumed(root, "tp1_whole")}
    out["refused"] = _refused(lambda: smp.resume_from_checkpoint(root, tag="tp1_part"))
    smp.reset()
    out["saved"] = _trained_and_saved(root, "tp2")[1]
    return out


def test_checkpoints_change_tensor_parallel_degree(tmp_path: Path) -> None:
    root = str(tmp_path)
    with single_process({}):
        saved_tp1 = _trained_and_saved(root, "tp1")[1]
    ranks = run_ranks(2, _at_tp2, root, timeout=120)
    for rank in ranks:
        assert rank["loaded"].keys() == saved_tp1.keys()
        for key, value in saved_tp1.items():
            torch.testing.assert_close(rank["loaded"][key], value, rtol=0, atol=0)
        assert rank["refused"] == _refusal(1, 2, tmp_path / "tp1_part_partial")
    saved_tp2 = ranks[0]["saved"]
    with single_process({}):
        loaded = _resumed(root, "tp2_whole")
        plain = _lm()
        plain.load_state_dict(torch.load(tmp_path / "tp2_whole"))  # strict: every key
        part = tmp_path / "tp2_part_partial"
        refused = _refused(lambda: smp.resume_from_checkpoint(root, tag="tp2_part"))
        model = smp.state.current_model()
        own_file = torch.load(part / "model_0_0_0.pt")
        by_hand = _refused(lambda: model.load_state_dict(own_file))
    for key, value in saved_tp2.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=0, atol=0)
    assert refused == _refusal(2, 1, part)
    assert by_hand == _refusal(2, 1)

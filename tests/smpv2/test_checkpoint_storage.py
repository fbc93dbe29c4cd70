"""``torch.sagemaker``'s distributed checkpoints in one process (no world): saving and loading
in local folders and on S3 (a local moto server, never AWS), what an asynchronous save writes
and when, what loading refuses to unpickle, a checkpoint that holds only part of a tensor,
keeping the newest checkpoint folders, ``init_optim_state`` and local state dicts.

Multi-rank saving and resuming: :mod:`tests.smpv2.test_checkpoint_resume`.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.sagemaker.checkpoint.utils import SORT_BY_LAST_INT, limit_num_subdirs
from torch.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
from torch.sagemaker.distributed.checkpoint.filesystem import (
    DistributedFileSystemReader,
    DistributedFileSystemWriter,
)
from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
from torch.sagemaker.distributed.checkpoint.state_dict_saver import (
    async_save,
    maybe_finalize_async_calls,
    save,
)
from torch.sagemaker.distributed.checkpoint.state_dict_utils import (
    SMStateDictType,
    init_optim_state,
    sm_state_dict_type,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def saved_state() -> dict[str, Any]:
    """What AWS's scripts put in a checkpoint beside tensors: numbers, a schedule's state, a
    numpy count, a Hugging Face config."""
    from transformers import LlamaConfig

    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
        "scheduler": {"last_epoch": 7, "base_lrs": [0.1]},
        "total_steps": 7,
        "num_params": np.int64(14),
        "model_config": LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2),
    }


def template() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "scheduler": {"last_epoch": 0, "base_lrs": [0.0]},
        "total_steps": 0,
        "num_params": np.int64(0),
        "model_config": None,
    }


def assert_loaded(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    for name in ("w", "b"):
        torch.testing.assert_close(loaded["model"][name], saved["model"][name])
    assert loaded["scheduler"] == saved["scheduler"]
    assert loaded["total_steps"] == saved["total_steps"]
    assert loaded["num_params"] == 14
    assert loaded["model_config"].hidden_size == 8


def test_save_then_load_in_place(tmp_path: Path) -> None:
    saved = saved_state()
    save(saved, checkpoint_id=tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".metadata", "__0_0.distcp"]
    loaded = template()
    weights = loaded["model"]["w"]
    load(loaded, checkpoint_id=tmp_path / "ckpt")
    assert_loaded(loaded, saved)
    assert loaded["model"]["w"] is weights  # in place: a model's own tensors are restored


def test_an_async_save_writes_a_copy_and_is_a_checkpoint_once_finished(tmp_path: Path) -> None:
    """Training may change the tensors as soon as ``async_save`` returns; the checkpoint has no
    metadata (a reader finds none, never a partial one) until ``maybe_finalize_async_calls``."""
    saved = saved_state()
    expected = saved["model"]["w"].clone()
    queue = AsyncCallsQueue()
    number = async_save(saved, checkpoint_id=tmp_path / "ckpt", queue=queue)
    saved["model"]["w"].add_(100.0)
    assert not (tmp_path / "ckpt" / ".metadata").exists()
    assert queue.get_num_unfinalized_calls() == 1
    assert queue.maybe_finalize_async_calls(blocking=True) == [number]
    assert queue.get_num_unfinalized_calls() == 0
    loaded = template()
    load(loaded, checkpoint_id=tmp_path / "ckpt")
    torch.testing.assert_close(loaded["model"]["w"], expected)
    queue.close()


def test_the_module_queue_serves_async_saves_given_no_queue(tmp_path: Path) -> None:
    async_save(saved_state(), checkpoint_id=tmp_path / "ckpt")
    assert len(maybe_finalize_async_calls(blocking=True)) == 1
    assert (tmp_path / "ckpt" / ".metadata").exists()
    assert maybe_finalize_async_calls(blocking=True) == []


class FailingWriter(DistributedFileSystemWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError("disk full")


def test_a_failed_background_write_fails_its_finalization(tmp_path: Path) -> None:
    queue = AsyncCallsQueue()
    async_save(saved_state(), storage_writer=FailingWriter(tmp_path / "ckpt"), queue=queue)
    with pytest.raises(CheckpointException, match="disk full"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert not (tmp_path / "ckpt" / ".metadata").exists()
    assert queue.get_num_unfinalized_calls() == 0


def test_checkpoints_on_s3(bucket: str) -> None:
    """Sync and async saves to ``s3://`` and back, also through a URL ``pathlib`` mangled (AWS's
    scripts' ``Path(checkpoint_dir)``: ``s3:/bucket/...``)."""
    saved = saved_state()
    save(saved, checkpoint_id=f"s3://{bucket}/ckpt/sync")
    queue = AsyncCallsQueue()
    async_save(saved, checkpoint_id=f"s3://{bucket}/ckpt/async", queue=queue)
    queue.close()
    for where in ("sync", "async"):
        loaded = template()
        load(
            loaded, storage_reader=DistributedFileSystemReader(Path(f"s3://{bucket}/ckpt/{where}"))
        )
        assert_loaded(loaded, saved)


class Planted:
    """A pickle that runs code when loaded: it touches ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_planted_metadata_is_not_unpickled(tmp_path: Path) -> None:
    """torch's own reader runs a planted ``.metadata``; a checkpoint read through
    ``torch.sagemaker`` refuses it before anything runs."""
    save({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "ckpt")
    marker = tmp_path / "ran"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointException, match=r"names posix\.system, which torch.s"):
        load({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "ckpt")
    assert not marker.exists()
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(2)}, storage_reader=dcp.FileSystemReader(tmp_path / "ckpt"))
    assert marker.exists()  # torch's reader ran it


def test_a_planted_entry_is_read_as_weights_only(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    save({"user": Planted(marker)}, checkpoint_id=tmp_path / "ckpt")
    with pytest.raises(CheckpointException, match="checkpoint entry 'user' holds more than"):
        load({"user": None}, checkpoint_id=tmp_path / "ckpt")
    assert not marker.exists()
    trusting = DistributedFileSystemReader(tmp_path / "ckpt", weights_only=False)
    load({"user": None}, storage_reader=trusting)
    assert marker.exists()  # the caller's explicit trust


def test_a_tensor_the_checkpoint_holds_only_part_of_fails_loading(tmp_path: Path) -> None:
    """As saved by ranks that held only half of it: torch's planner reads the half it finds and
    leaves the rest as it was; here loading fails naming the tensor."""
    save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "ckpt")
    metadata_file = tmp_path / "ckpt" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    metadata.state_dict_metadata["w"].size = torch.Size([8])  # one chunk of 4 of 8
    metadata_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointException, match="w holds only 4 of the 8 elements"):
        load({"w": torch.zeros(8)}, checkpoint_id=tmp_path / "ckpt")
    silently = {"w": torch.zeros(8)}
    dcp.load(silently, storage_reader=dcp.FileSystemReader(tmp_path / "ckpt"))
    assert silently["w"].tolist() == [1.0] * 4 + [0.0] * 4


def test_a_coordinator_outside_the_group_is_refused(tmp_path: Path) -> None:
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        with pytest.raises(ValueError, match=r"coordinator_rank 3 is not in the process group"):
            save({"w": torch.ones(1)}, checkpoint_id=tmp_path / "ckpt", coordinator_rank=3)
        save({"w": torch.ones(1)}, checkpoint_id=tmp_path / "ckpt", coordinator_rank=0)
    finally:
        torch.distributed.destroy_process_group()
    assert (tmp_path / "ckpt" / ".metadata").exists()


def test_limit_num_subdirs_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    """AWS's call: the path just saved to (a tp rank's folder inside the checkpoint), the
    checkpoints matched by a regex and ordered by their last number."""
    for name in ("llama-1steps", "llama-2steps", "llama-10steps", "llama-3steps", "logs"):
        (tmp_path / name).mkdir()
    regex = r"^.*\d+steps$"
    saved = tmp_path / "llama-10steps" / "tp2-0"
    assert limit_num_subdirs(saved, 2, sort_fn=SORT_BY_LAST_INT, regex=regex, log=False) == []
    removed = limit_num_subdirs(saved, 2, sort_fn=SORT_BY_LAST_INT, regex=regex, log=True)
    assert [p.name for p in removed] == ["llama-1steps", "llama-2steps"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-10steps", "llama-3steps", "logs"]
    assert SORT_BY_LAST_INT("gpt-neox-7b-200steps") == 200
    with pytest.raises(ValueError, match="not a local folder"):
        limit_num_subdirs("s3://bucket/llama-2steps", 1)


def test_init_optim_state_creates_state_without_changing_parameters() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    empty = nn.Parameter(torch.zeros(0))  # FSDP's original parameter outside this rank's shard
    optimizer = torch.optim.AdamW([*model.parameters(), empty], lr=0.1, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    init_optim_state(optimizer, skip_empty_param=True)
    for param, old in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(param, old)
        assert param.grad is None
        assert optimizer.state[param]["exp_avg"].abs().sum() == 0
    assert empty not in optimizer.state
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_a_local_state_dict_is_the_modules_own_tensors() -> None:
    """Without FSDP: each parameter and persistent buffer by name, loadable in place."""
    model = nn.BatchNorm1d(3)
    model.register_buffer("scratch", torch.ones(1), persistent=False)
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state = model.state_dict()
        assert set(state) == {
            "weight",
            "bias",
            "running_mean",
            "running_var",
            "num_batches_tracked",
        }
        assert state["weight"].data_ptr() == model.weight.data_ptr()
        model.load_state_dict({**state, "weight": torch.full((3,), 2.0)})
    assert model.weight.tolist() == [2.0] * 3
    assert "state_dict" not in vars(model)  # the module's own methods again

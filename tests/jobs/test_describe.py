"""``dtrain describe`` without a job run: SageMaker's shapes and the defaults a job used."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from dtrain.jobs.describe import describe
from dtrain.jobs.spec import ChannelSpec, JobSpec
from dtrain.jobs.store import COMPLETED, JobStore


def _job(tmp_path: Path, **spec: object) -> tuple[JobStore, Path]:
    tmp_path.mkdir(exist_ok=True)
    store = JobStore(tmp_path / "jobs.db")
    folder = tmp_path / "jobs" / "j"
    store.create("j", JobSpec(entry_point="train.py", job_name="j", **spec).to_json(), folder)
    return store, folder


def test_the_last_transition_ends_when_it_starts_or_later(tmp_path: Path) -> None:
    store, _ = _job(tmp_path)
    store.update("j", secondary_status="Training", message="Training")
    ended = time.time()  # as the controller does: the end time is taken before the update
    store.update("j", status=COMPLETED, secondary_status="Completed", end_time=ended)
    transitions = describe(store, "j")["SecondaryStatusTransitions"]
    assert [t["Status"] for t in transitions] == ["Starting", "Training", "Completed"]
    for transition in transitions:
        start = datetime.fromisoformat(transition["StartTime"])
        assert start <= datetime.fromisoformat(transition["EndTime"])


def test_channels_in_sagemakers_shape(tmp_path: Path) -> None:
    channel = ChannelSpec("training", "s3://bucket/train", distribution="ShardedByS3Key")
    store, _ = _job(tmp_path, channels=(channel,))
    assert describe(store, "j")["InputDataConfig"] == [
        {
            "ChannelName": "training",
            "DataSource": {
                "S3DataSource": {
                    "S3DataType": "S3Prefix",
                    "S3Uri": "s3://bucket/train",
                    "S3DataDistributionType": "ShardedByS3Key",
                }
            },
            "ContentType": None,
            "InputMode": "File",
        }
    ]


def test_default_checkpoint_folders_are_named(tmp_path: Path) -> None:
    store, folder = _job(tmp_path)
    one = describe(store, "j")["CheckpointConfig"]["LocalPath"]
    assert one == str(folder / "hosts" / "algo-1" / "checkpoints")
    store, folder = _job(tmp_path / "two", instance_count=2)
    two = describe(store, "j")["CheckpointConfig"]["LocalPath"]
    assert two == str(folder / "hosts" / "algo-*" / "checkpoints")
    store, _ = _job(tmp_path / "given", checkpoint_local_path="/data/ckpt")
    assert describe(store, "j")["CheckpointConfig"]["LocalPath"] == "/data/ckpt"

"""What a user asked for when submitting a training job.

The CLI and the Estimator both build one.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

SHARDING_TYPES = ("FullyReplicated", "ShardedByS3Key")


@dataclass(frozen=True)
class ChannelSpec:
    """One input channel: a name and where its data lives (local path, ``file://`` or ``s3://``)."""

    name: str
    uri: str
    distribution: str = "FullyReplicated"
    content_type: str | None = None
    input_mode: str = "File"


@dataclass(frozen=True)
class JobSpec:
    """A training job request, before validation turns it into a launch plan."""

    entry_point: str
    job_name: str
    instance_count: int = 1
    processes_per_host: int | None = None
    instance_type: str = "local"
    distribution: dict[str, Any] | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    channels: tuple[ChannelSpec, ...] = ()
    source_dir: str | None = None
    max_run: int = 24 * 60 * 60
    output_path: str | None = None
    checkpoint_local_path: str | None = None
    metric_definitions: tuple[dict[str, str], ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    max_retry_attempts: int = 0
    cluster: str = "local"
    """Where the hosts are: ``local``, ``join://ADDR:PORT`` or ``ray://ADDR:PORT``."""
    secret_file: str | None = None
    """The job's secret, which joining agents must prove (``join://`` clusters)."""
    join_timeout: float = 600.0
    """How long the controller waits for every host's agent to join."""
    tensorboard_output_config: dict[str, str] | None = None
    """SageMaker's ``TensorBoardOutputConfig`` (``S3OutputPath``, ``LocalPath``), if given."""
    key_salt: str = ""
    """Random, made when the job is submitted: the ranks' keys are this job's own even where
    other jobs share its secret (:mod:`dtrain.sealed`)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        data = json.loads(text)
        data["channels"] = tuple(ChannelSpec(**c) for c in data.get("channels", ()))
        data["metric_definitions"] = tuple(data.get("metric_definitions", ()))
        return cls(**data)

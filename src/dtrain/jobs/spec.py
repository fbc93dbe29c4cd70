"""What a user asked for when submitting a training job.

The CLI and the Estimator both build one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, overload

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
    """The script (a path, relative to ``source_dir`` if given) or, with ``module``, a module."""
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
    hidden_environment: tuple[str, ...] = ()
    """Variables whose values ``dtrain describe`` does not show: given by name or in a file
    (``--environment NAME``, ``--environment-file``), never on a command line."""
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
    module: bool = False
    """``entry_point`` names a module of ``source_dir``, run as ``python -m`` runs it."""
    script_args: tuple[str, ...] = ()
    """Arguments for the script after the hyperparameters' (``dtrain run ... -- ARGS``)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        data = json.loads(text)
        data["channels"] = tuple(ChannelSpec(**c) for c in data.get("channels", ()))
        data["metric_definitions"] = tuple(data.get("metric_definitions", ()))
        data["script_args"] = tuple(data.get("script_args", ()))
        data["hidden_environment"] = tuple(data.get("hidden_environment", ()))
        return cls(**data)

    def with_absolute_paths(self) -> JobSpec:
        """The spec with its local paths made absolute, so that it means the same from any
        folder (``dtrain rerun``). Channels and the checkpoint folder are paths on each host:
        only a local job's, whose hosts share this folder, are made absolute."""
        local = self.cluster == "local"
        return dataclasses.replace(
            self,
            entry_point=(
                self.entry_point if self.source_dir or self.module else _absolute(self.entry_point)
            ),
            source_dir=_absolute(self.source_dir),
            output_path=_absolute(self.output_path),
            secret_file=_absolute(self.secret_file),
            channels=tuple(
                dataclasses.replace(c, uri=_absolute(c.uri)) if local else c for c in self.channels
            ),
            checkpoint_local_path=(
                _absolute(self.checkpoint_local_path) if local else self.checkpoint_local_path
            ),
            tensorboard_output_config=_absolute_output(self.tensorboard_output_config),
        )


@overload
def _absolute(path: str) -> str: ...
@overload
def _absolute(path: str | None) -> str | None: ...
def _absolute(path: str | None) -> str | None:
    """A local path made absolute; URIs (``s3://``, ``file://``) and ``None`` stay as they are."""
    if path is None or "://" in path:
        return path
    return os.path.abspath(path)


def _absolute_output(config: dict[str, str] | None) -> dict[str, str] | None:
    """``TensorBoardOutputConfig`` with its ``S3OutputPath`` absolute (the controller writes
    there); its ``LocalPath`` is a path on the hosts, under ``/opt/ml``."""
    if not config or not config.get("S3OutputPath"):
        return config
    return {**config, "S3OutputPath": _absolute(config["S3OutputPath"])}

"""``dtrain describe``: a job as SageMaker's DescribeTrainingJob would show it."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from dtrain.jobs.folder import JobFolder
from dtrain.jobs.metrics import final_metric_data_list
from dtrain.jobs.spec import ChannelSpec, JobSpec
from dtrain.jobs.store import JobRecord, JobStore

HIDDEN_VALUE = "(hidden)"
"""What ``Environment`` shows for a value no command line showed (given by name or in a file)."""


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc).isoformat()


def _input_channel(channel: ChannelSpec) -> dict[str, Any]:
    """SageMaker's ``Channel`` shape; the URI may also be a local path or ``file://`` URL."""
    return {
        "ChannelName": channel.name,
        "DataSource": {
            "S3DataSource": {
                "S3DataType": "S3Prefix",
                "S3Uri": channel.uri,
                "S3DataDistributionType": channel.distribution,
            }
        },
        "ContentType": channel.content_type,
        "InputMode": channel.input_mode,
    }


def _default_checkpoints(record: JobRecord, spec: JobSpec) -> str:
    """Where the hosts kept checkpoints when no ``checkpoint_local_path`` was given: each its
    own ``checkpoints`` folder (``algo-*`` stands for every host of a multi-host job)."""
    folder = JobFolder(Path(record.folder))
    if spec.instance_count == 1:
        return str(folder.host(0).checkpoints_dir)
    return str(folder.root / "hosts" / "algo-*" / "checkpoints")


def describe(store: JobStore, name: str) -> dict[str, Any]:
    """The DescribeTrainingJob fields that mean something for a local job."""
    record: JobRecord = store.get(name)
    spec = JobSpec.from_json(record.spec)
    transitions = store.transitions(name)
    secondary = []
    for i, transition in enumerate(transitions):
        end = transitions[i + 1].start_time if i + 1 < len(transitions) else record.end_time
        entry = {"Status": transition.status, "StartTime": _iso(transition.start_time)}
        if end is not None and (i + 1 < len(transitions) or record.is_terminal):
            entry["EndTime"] = _iso(end)
        entry["StatusMessage"] = transition.message
        secondary.append(entry)
    training_seconds = None
    if record.start_time is not None and record.end_time is not None:
        training_seconds = round(record.end_time - record.start_time)
    description: dict[str, Any] = {
        "TrainingJobName": record.name,
        "TrainingJobStatus": record.status,
        "SecondaryStatus": record.secondary_status,
        "FailureReason": record.failure_reason,
        "HyperParameters": {k: json.dumps(v) for k, v in spec.hyperparameters.items()},
        "AlgorithmSpecification": {
            "TrainingInputMode": "File",
            "EntryPoint": f"-m {spec.entry_point}" if spec.module else spec.entry_point,
            "SourceDir": spec.source_dir,
            "ContainerArguments": list(spec.script_args),
        },
        "ResourceConfig": {
            "InstanceType": spec.instance_type,
            "InstanceCount": spec.instance_count,
            "ProcessesPerHost": spec.processes_per_host,
        },
        "Cluster": spec.cluster,
        "Hosts": [
            {
                "Name": host["name"],
                "Address": host["address"],
                "Interface": host["interface"],
                "Hostname": host["hostname"],
                "AgentPid": host["pid"],
            }
            for host in store.hosts(name)
        ],
        "StoppingCondition": {"MaxRuntimeInSeconds": spec.max_run},
        "InputDataConfig": [_input_channel(channel) for channel in spec.channels],
        "OutputDataConfig": {"S3OutputPath": spec.output_path},
        "CheckpointConfig": {
            "LocalPath": spec.checkpoint_local_path or _default_checkpoints(record, spec)
        },
        "Environment": {
            name: HIDDEN_VALUE if name in spec.hidden_environment else value
            for name, value in spec.environment.items()
        },
        "RetryStrategy": {"MaximumRetryAttempts": spec.max_retry_attempts},
        "CreationTime": _iso(record.creation_time),
        "TrainingStartTime": _iso(record.start_time),
        "TrainingEndTime": _iso(record.end_time),
        "LastModifiedTime": _iso(record.last_modified),
        "TrainingTimeInSeconds": training_seconds,
        "ModelArtifacts": {"S3ModelArtifacts": record.model_artifacts},
        "SecondaryStatusTransitions": secondary,
        "FinalMetricDataList": final_metric_data_list(store.metrics(name)),
        "JobFolder": record.folder,
    }
    if spec.distribution:
        description["Distribution"] = spec.distribution
    if spec.tensorboard_output_config:
        description["TensorBoardOutputConfig"] = spec.tensorboard_output_config
    return description

"""TensorBoard event files of a job: its metrics, and the events its ranks wrote themselves.

SageMaker sends the values its metric definitions capture to CloudWatch, and copies what the
ranks write under ``TensorBoardOutputConfig.LocalPath`` (default ``/opt/ml/output/tensorboard``)
to ``S3OutputPath``. dtrain keeps both as TensorBoard runs in the job folder, so one
``tensorboard --logdir`` shows them side by side:

``tensorboard/metrics/``
    the metric definitions' samples, one scalar tag per metric, written as they are captured;
``tensorboard/<host>/``
    each host's ``LocalPath`` as its ranks left it, collected when the job ends.

With ``S3OutputPath`` given, that folder is then copied to
``<S3OutputPath>/<job>/tensorboard-output/``: a folder per job, so that jobs sharing an output
path, as SageMaker users share a bucket, do not mix their runs.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import socket
import time
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from dtrain.errors import ConfigError, UnknownKeyError
from dtrain.jobs.folder import HostFolder, make_private_dirs
from dtrain.jobs.metrics import MetricSample

CONTAINER_ROOT = PurePosixPath("/opt/ml")
DEFAULT_LOCAL_PATH = "/opt/ml/output/tensorboard"
METRICS_RUN = "metrics"
_CONFIG_KEYS = ("S3OutputPath", "LocalPath")
_KEY = "tensorboard_output_config"


def validate_tensorboard_output_config(config: object) -> None:
    """SageMaker's ``TensorBoardOutputConfig``: ``S3OutputPath`` (a local path, ``file://`` or
    ``s3://``; required by SageMaker, optional here, where the job folder keeps the events
    anyway) and ``LocalPath``, an absolute path under ``/opt/ml``, which is each host's folder
    here (the ranks' ``SAGEMAKER_BASE_DIR``)."""
    if not isinstance(config, Mapping):
        raise ConfigError(_KEY, config, '{"S3OutputPath": URI, "LocalPath": "/opt/ml/..."}')
    for key in config:
        if key not in _CONFIG_KEYS:
            raise UnknownKeyError(_KEY, str(key), _CONFIG_KEYS)
    output = config.get("S3OutputPath")
    if output is not None and (not isinstance(output, str) or not output):
        raise ConfigError(f"{_KEY}.S3OutputPath", output, "a local path, file:// or s3:// URL")
    local_path(config)


def local_path(config: Mapping[str, Any] | None) -> PurePosixPath:
    """Where the ranks write their events, relative to the host's ``/opt/ml``."""
    text = (config or {}).get("LocalPath") or DEFAULT_LOCAL_PATH
    path = PurePosixPath(posixpath.normpath(text)) if isinstance(text, str) else None
    if path is None or CONTAINER_ROOT not in path.parents:
        raise ConfigError(
            f"{_KEY}.LocalPath",
            text,
            f"an absolute path inside {CONTAINER_ROOT} (each host's folder), e.g. "
            f"{DEFAULT_LOCAL_PATH}",
        )
    return path.relative_to(CONTAINER_ROOT)


def host_tensorboard_dir(host: HostFolder, config: Mapping[str, Any] | None) -> Path:
    """The folder of ``host`` that stands for its ``LocalPath``."""
    return host.root / local_path(config)


class MetricEvents:
    """Metric samples as TensorBoard scalars: tag = metric name, step = its sample count, wall
    time = when the line was read.

    Records are framed by tensorboard's own ``RecordWriter`` (the format torch's
    ``SummaryWriter`` writes), on the thread that reads the ranks' output, synchronously: its
    ``EventFileWriter`` hands each event to a writer thread, 0.1 ms an event here, enough for a
    script logging 20,000 lines at once to hold that thread past the hosts' heartbeat limit
    (10 us an event without it). Nor does the controller import torch for it. The file is made
    at the first sample and flushed after each batch, so TensorBoard shows a running job's
    metrics.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._records: Any = None

    def add(self, samples: Iterable[MetricSample]) -> None:
        samples = list(samples)
        if not samples:  # most output has none: no import on the output's path (~70 ms)
            return
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._records is None:
            self._records = self._open(Event)
        for sample in samples:
            value = Summary.Value(tag=sample.name, simple_value=sample.value)
            event = Event(
                wall_time=sample.timestamp, step=sample.step, summary=Summary(value=[value])
            )
            self._records.write(event.SerializeToString())
        self._records.flush()

    def _open(self, event: Any) -> Any:
        """A new event file, private to the user, opened with the version record readers expect."""
        from tensorboard.summary.writer.record_writer import RecordWriter

        make_private_dirs(self.folder)
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}"
        descriptor = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        records = RecordWriter(os.fdopen(descriptor, "wb"))
        records.write(event(wall_time=now, file_version="brain.Event:2").SerializeToString())
        return records

    def close(self) -> None:
        if self._records is not None:
            self._records.close()


def publish(folder: Path, output_url: str, job_name: str) -> str:
    """Copy the job's ``tensorboard/`` to ``<output_url>/<job>/tensorboard-output``; its URL."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    target = f"{output_url}/{job_name}/tensorboard-output"
    fs, path = fsspec.core.url_to_fs(target)
    if isinstance(fs, LocalFileSystem):  # private to the user, as the job's other outputs
        make_private_dirs(Path(path))
        shutil.copytree(folder, path, dirs_exist_ok=True)
    else:
        fs.put(f"{folder}/", path, recursive=True)
    return target

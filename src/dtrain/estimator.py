"""SageMaker Python SDK look-alike: ``PyTorch(...).fit(...)`` runs a dtrain job.

On this machine by default, or across machines with ``cluster=`` (see ``dtrain run --cluster``).

Notebooks written for SageMaker keep working: AWS-only arguments are accepted and ignored (with one
warning), SageMaker's argument names and defaults are kept, and ``ml.*`` instance types get an error
that says what to use instead.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError, DtrainError, JobFailedError, did_you_mean
from dtrain.jobs.spec import ChannelSpec, JobSpec
from dtrain.launch.job import default_job_name, prepare, validate_instance_type
from dtrain.launch.submit import spec_command, start_detached

# Arguments of SageMaker's EstimatorBase/Framework/PyTorch that only mean something on AWS.
AWS_ONLY_ARGUMENTS = frozenset(
    {
        "role", "sagemaker_session", "framework_version", "py_version", "image_uri",
        "debugger_hook_config", "disable_profiler", "profiler_config", "rules",
        "volume_size", "volume_kms_key", "output_kms_key", "tags",
        "subnets", "security_group_ids", "use_spot_instances", "max_wait", "checkpoint_s3_uri",
        "code_location", "container_log_level", "dependencies", "git_config",
        "enable_network_isolation", "encrypt_inter_container_traffic", "enable_sagemaker_metrics",
        "keep_alive_period_in_seconds", "input_mode", "model_uri", "model_channel_name",
        "compiler_config", "training_recipe", "recipe_overrides", "disable_output_compression",
        "enable_remote_debug", "enable_infra_check", "container_entry_point", "container_arguments",
        "training_repository_access_mode", "training_repository_credentials_provider_arn",
        "enable_session_tag_chaining", "training_plan", "instance_placement_config",
    }
)  # fmt: skip


class TrainingInput:
    """A channel's data source, as SageMaker's ``sagemaker.inputs.TrainingInput``."""

    def __init__(
        self,
        s3_data: str,
        distribution: str | None = None,
        compression: str | None = None,
        content_type: str | None = None,
        record_wrapping: str | None = None,
        s3_data_type: str = "S3Prefix",
        input_mode: str | None = None,
        **unused: Any,
    ) -> None:
        if compression is not None:
            raise ConfigError(
                "TrainingInput.compression", compression, "None (Gzip needs Pipe mode)"
            )
        if s3_data_type != "S3Prefix":
            raise ConfigError("TrainingInput.s3_data_type", s3_data_type, "'S3Prefix'")
        if input_mode not in (None, "File"):
            raise ConfigError("TrainingInput.input_mode", input_mode, "'File' (or None)")
        if record_wrapping not in (None, "None"):
            raise ConfigError("TrainingInput.record_wrapping", record_wrapping, "None")
        self.s3_data = s3_data
        self.distribution = distribution or "FullyReplicated"
        self.content_type = content_type

    def channel(self, name: str) -> ChannelSpec:
        return ChannelSpec(name, self.s3_data, self.distribution, self.content_type)


class TensorBoardOutputConfig:
    """Where a job's TensorBoard events go, as SageMaker's ``sagemaker.debugger``
    ``TensorBoardOutputConfig``: ``s3_output_path`` (a path, ``file://`` or ``s3://`` here) and
    the ranks' folder ``container_local_output_path`` (default ``/opt/ml/output/tensorboard``)."""

    def __init__(self, s3_output_path: str, container_local_output_path: str | None = None) -> None:
        self.s3_output_path = s3_output_path
        self.container_local_output_path = container_local_output_path

    def _to_request_dict(self) -> dict[str, str]:
        """CreateTrainingJob's ``TensorBoardOutputConfig``."""
        request = {"S3OutputPath": self.s3_output_path}
        if self.container_local_output_path is not None:
            request["LocalPath"] = self.container_local_output_path
        return request


def _tensorboard_request(config: Any) -> dict[str, str] | None:
    """``tensorboard_output_config`` as a request dict: ours, the SageMaker SDK's own object (it
    has the same attributes), or the dict itself."""
    if config is None or isinstance(config, Mapping):
        return None if config is None else dict(config)
    if not hasattr(config, "s3_output_path"):
        raise ConfigError(
            "tensorboard_output_config", config, "a TensorBoardOutputConfig or a dict"
        )
    local = getattr(config, "container_local_output_path", None)
    return TensorBoardOutputConfig(config.s3_output_path, local)._to_request_dict()


def _channels(inputs: str | TrainingInput | Mapping[str, str | TrainingInput] | None) -> tuple:
    """``fit`` inputs: one URI or TrainingInput (channel ``training``) or a dict of channels."""
    if inputs is None:
        return ()
    if isinstance(inputs, str | TrainingInput):
        inputs = {"training": inputs}
    if not isinstance(inputs, Mapping):
        raise ConfigError("inputs", inputs, "a URI, a TrainingInput or a dict of them")
    channels = []
    for name, source in inputs.items():
        source = TrainingInput(source) if isinstance(source, str) else source
        if not isinstance(source, TrainingInput):
            raise ConfigError(f"inputs.{name}", source, "a URI string or a TrainingInput")
        channels.append(source.channel(name))
    return tuple(channels)


class TrainingJob:
    """A submitted job.

    ``describe()``, ``wait()``, ``stop()`` and ``logs()`` go through the job store.
    """

    def __init__(self, name: str, process: subprocess.Popen[str] | None = None) -> None:
        self.name = name
        self.job_name = name
        self._process = process

    def describe(self) -> dict[str, Any]:
        from dtrain.jobs.describe import describe
        from dtrain.jobs.store import JobStore

        return describe(JobStore(), self.name)

    def wait(self, logs: bool = True) -> dict[str, Any]:
        """Block until the job ends (printing its output with ``logs``).

        Raise if it did not complete.
        """
        if self._process is not None and self._process.stdout is not None:
            for line in self._process.stdout:
                if logs:
                    sys.stdout.write(line)
            self._process.wait()
        else:
            self._follow(logs)
        description = self.describe()
        if description["TrainingJobStatus"] != "Completed":
            raise JobFailedError(
                self.name, description["TrainingJobStatus"], description.get("FailureReason")
            )
        return description

    def _follow(self, logs: bool) -> None:
        from dtrain.jobs.folder import JobFolder
        from dtrain.jobs.logs import labelled_logs, print_logs
        from dtrain.jobs.store import JobStore

        store = JobStore()
        if logs:
            folder = JobFolder.for_job(self.name)
            files = lambda: labelled_logs(folder.logs_dir)  # noqa: E731
            finished = lambda: store.get(self.name).is_terminal  # noqa: E731
            print_logs(files, sys.stdout, follow=True, finished=finished)
        store.wait(self.name)

    def stop(self) -> None:
        from dtrain.jobs.store import JobStore

        JobStore().request_stop(self.name)


class PyTorch:
    """SageMaker's ``sagemaker.pytorch.PyTorch`` estimator.

    It runs jobs with dtrain, on this machine or the machines of ``cluster``.
    """

    def __init__(
        self,
        entry_point: str,
        source_dir: str | None = None,
        hyperparameters: Mapping[str, Any] | None = None,
        instance_type: str = "local",
        instance_count: int = 1,
        distribution: Mapping[str, Any] | None = None,
        metric_definitions: list[dict[str, str]] | None = None,
        max_run: int = 24 * 60 * 60,
        checkpoint_local_path: str | None = None,
        output_path: str | None = None,
        environment: Mapping[str, str] | None = None,
        base_job_name: str | None = None,
        max_retry_attempts: int | None = None,
        processes_per_host: int | None = None,
        cluster: str = "local",
        secret_file: str | None = None,
        join_timeout: float = 600.0,
        tensorboard_output_config: TensorBoardOutputConfig | Mapping[str, str] | None = None,
        **aws_only: Any,
    ) -> None:
        unknown = sorted(set(aws_only) - AWS_ONLY_ARGUMENTS)
        if unknown:
            suggestion = did_you_mean(unknown[0], [*AWS_ONLY_ARGUMENTS, *self._own_arguments()])
            hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
            raise TypeError(f"PyTorch() got an unexpected keyword argument {unknown[0]!r}{hint}")
        if aws_only:
            warnings.warn(
                "dtrain runs jobs on your own machines; ignoring AWS-only arguments: "
                + ", ".join(sorted(aws_only)),
                stacklevel=2,
            )
        validate_instance_type(instance_type)
        self.entry_point = entry_point
        self.source_dir = source_dir
        self._hyperparameters = dict(hyperparameters or {})
        self.instance_type = instance_type
        self.instance_count = instance_count
        self.distribution = dict(distribution) if distribution else None
        self.metric_definitions = list(metric_definitions or [])
        self.max_run = max_run
        self.checkpoint_local_path = checkpoint_local_path
        self.output_path = output_path
        self.environment = dict(environment or {})
        self.base_job_name = base_job_name
        self.max_retry_attempts = max_retry_attempts or 0
        self.processes_per_host = processes_per_host
        self.cluster = cluster
        self.secret_file = secret_file
        self.join_timeout = join_timeout
        self.tensorboard_output_config = _tensorboard_request(tensorboard_output_config)
        self.latest_training_job: TrainingJob | None = None

    @staticmethod
    def _own_arguments() -> list[str]:
        import inspect

        return [p for p in inspect.signature(PyTorch.__init__).parameters if p != "self"]

    def hyperparameters(self) -> dict[str, Any]:
        return dict(self._hyperparameters)

    def set_hyperparameters(self, **kwargs: Any) -> None:
        self._hyperparameters.update(kwargs)

    def _spec(self, inputs: Any, job_name: str | None) -> JobSpec:
        base = self.base_job_name or Path(self.entry_point).stem
        return JobSpec(
            entry_point=self.entry_point,
            job_name=job_name or default_job_name(base),
            instance_count=self.instance_count,
            processes_per_host=self.processes_per_host,
            instance_type=self.instance_type,
            distribution=self.distribution,
            hyperparameters=self._hyperparameters,
            channels=_channels(inputs),
            source_dir=self.source_dir,
            max_run=self.max_run,
            output_path=self.output_path,
            checkpoint_local_path=self.checkpoint_local_path,
            metric_definitions=tuple(self.metric_definitions),
            environment=self.environment,
            max_retry_attempts=self.max_retry_attempts,
            cluster=self.cluster,
            secret_file=self.secret_file,
            join_timeout=self.join_timeout,
            tensorboard_output_config=self.tensorboard_output_config,
        )

    def fit(
        self,
        inputs: str | TrainingInput | Mapping[str, str | TrainingInput] | None = None,
        wait: bool = True,
        logs: bool | str = True,
        job_name: str | None = None,
        experiment_config: Mapping[str, str] | None = None,
    ) -> None:
        """Validate, then run the job in a supervising process.

        With ``wait``, block until it ends; without, return once the job is recorded, detached
        as ``dtrain run --detach`` does (a job that cannot start raises here).
        """
        spec = self._spec(inputs, job_name)
        if not wait:
            detached = start_detached(spec)
            if not detached.started:
                said = detached.said.strip() or f"its controller exited with {detached.status}"
                raise DtrainError(f"job {spec.job_name} did not start: {said}")
            self.latest_training_job = TrainingJob(spec.job_name)
            return
        prepare(spec)
        process = subprocess.Popen(
            spec_command(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.latest_training_job = TrainingJob(spec.job_name, process)
        try:
            self.latest_training_job.wait(logs=logs not in (False, "None"))
        except KeyboardInterrupt:
            process.send_signal(signal.SIGINT)
            process.wait()
            raise

    @property
    def model_data(self) -> str | None:
        if self.latest_training_job is None:
            raise DtrainError("no job has been run yet: call fit() first")
        return self.latest_training_job.describe()["ModelArtifacts"]["S3ModelArtifacts"]

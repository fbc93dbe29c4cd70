"""A training job from request to final status: validate, lay out folders, run the ranks, upload."""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from dtrain.config.distribution import DistributionPlan, resolve_distribution
from dtrain.errors import ConfigError, DtrainError
from dtrain.jobs.channels import materialize_channel, validate_channels
from dtrain.jobs.folder import JOB_NAME_PATTERN, JobFolder
from dtrain.jobs.metrics import MetricExtractor, validate_metric_definitions
from dtrain.jobs.spec import JobSpec
from dtrain.jobs.store import COMPLETED, FAILED, STOPPED, STOPPING, JobRecord, JobStore
from dtrain.launch.artifacts import resolve_output_path, upload_artifacts
from dtrain.launch.env import LaunchPlan, count_gpus
from dtrain.launch.supervisor import Outcome, RankLaunch, Supervisor
from dtrain.topology import host_name

LOCAL_INSTANCE_TYPES = ("local", "local_cpu", "local_gpu")
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=30)


def default_job_name(base: str) -> str:
    """SageMaker's naming: ``<base>-YYYY-MM-DD-HH-MM-SS-mmm``.

    The base is cleaned to the allowed characters.
    """
    base = re.sub(r"[^a-zA-Z0-9-]+", "-", base).strip("-")[:32] or "job"
    now = datetime.datetime.now()
    return f"{base}-{now:%Y-%m-%d-%H-%M-%S}-{now.microsecond // 1000:03d}"


def validate_instance_type(instance_type: str) -> None:
    if instance_type in LOCAL_INSTANCE_TYPES:
        return
    hint = (
        "dtrain runs jobs on this machine; use instance_type='local' (GPUs if present), "
        "'local_gpu' or 'local_cpu', and instance_count for the number of simulated hosts"
    )
    raise ConfigError(
        "instance_type", instance_type, f"one of {', '.join(LOCAL_INSTANCE_TYPES)}; {hint}"
    )


def gpus_per_host(instance_type: str, instance_count: int) -> int:
    """The machine's GPUs shared out between simulated hosts; none for ``local_cpu``."""
    if instance_type == "local_cpu":
        return 0
    gpus = count_gpus()
    if instance_type == "local_gpu" and gpus < instance_count:
        raise ConfigError(
            "instance_type",
            instance_type,
            f"at least one GPU per host: {instance_count} host(s) but this machine has"
            f" {gpus} GPU(s);"
            " use 'local_cpu' or fewer instances",
        )
    return gpus // instance_count


@dataclass(frozen=True)
class PreparedJob:
    """A job request that passed every check; nothing has been created or started yet."""

    spec: JobSpec
    distribution: DistributionPlan
    gpus_per_host: int
    hyperparameters: dict[str, Any]
    output_url: str


def _check_entry_point(spec: JobSpec) -> None:
    if spec.source_dir is not None:
        source = Path(spec.source_dir)
        if not source.is_dir():
            raise ConfigError("source_dir", spec.source_dir, "an existing directory")
        entry = source / spec.entry_point
    else:
        entry = Path(spec.entry_point)
    if not entry.is_file():
        where = f" inside source_dir {spec.source_dir!r}" if spec.source_dir else ""
        raise ConfigError("entry_point", spec.entry_point, f"an existing file{where}")


def prepare(spec: JobSpec) -> PreparedJob:
    """Check the whole request before anything launches; every error names its key and value."""
    if not JOB_NAME_PATTERN.match(spec.job_name):
        raise ConfigError(
            "job_name",
            spec.job_name,
            "1-63 letters, digits and hyphens, starting with a letter or digit",
        )
    validate_instance_type(spec.instance_type)
    if not isinstance(spec.instance_count, int) or spec.instance_count < 1:
        raise ConfigError("instance_count", spec.instance_count, "an integer >= 1")
    if not isinstance(spec.max_run, int | float) or spec.max_run <= 0:
        raise ConfigError("max_run", spec.max_run, "a number of seconds > 0")
    if not isinstance(spec.max_retry_attempts, int) or not 0 <= spec.max_retry_attempts <= 30:
        raise ConfigError("max_retry_attempts", spec.max_retry_attempts, "an integer from 0 to 30")
    _check_entry_point(spec)
    gpus = gpus_per_host(spec.instance_type, spec.instance_count)
    plan = resolve_distribution(
        spec.distribution,
        instance_count=spec.instance_count,
        processes_per_host=spec.processes_per_host,
        default_processes_per_host=max(gpus, 1),
        instance_type=spec.instance_type,
    )
    if gpus and plan.processes_per_host > gpus:
        raise ConfigError(
            "processes_per_host",
            plan.processes_per_host,
            f"at most the {gpus} GPU(s) each host has (one process per GPU)",
        )
    validate_metric_definitions(spec.metric_definitions)
    validate_channels(spec.channels)
    for key, value in spec.environment.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError(f"environment.{key}", value, "string keys and string values")
    hyperparameters = dict(spec.hyperparameters)
    for key in hyperparameters:
        if not isinstance(key, str) or not key:
            raise ConfigError("hyperparameters", key, "non-empty string keys")
    hyperparameters.update(plan.framework_hyperparameters)
    return PreparedJob(spec, plan, gpus, hyperparameters, resolve_output_path(spec.output_path))


def _free_loopback_listener() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    return listener


def _copy_code(spec: JobSpec, code_dir: Path) -> None:
    """Like SageMaker's ``sourcedir.tar.gz``: the source dir, or the entry point alone.

    dtrain's home may lie inside the source dir (a project folder holding both): the folder
    that holds the job's own copy is left out, or the copy would copy itself without end.
    """
    if spec.source_dir is not None:
        copy = code_dir.resolve()

        def ignore(folder: str, names: list[str]) -> set[str]:
            return {
                name
                for name in names
                if name == "__pycache__" or _holds(Path(folder, name).resolve(), copy)
            }

        shutil.copytree(spec.source_dir, code_dir, ignore=ignore)
    else:
        code_dir.mkdir(parents=True)
        shutil.copy2(spec.entry_point, code_dir / Path(spec.entry_point).name)


def _holds(folder: Path, path: Path) -> bool:
    return folder == path or folder in path.parents


class JobRun:
    """Runs one prepared job, recording every status change in the store."""

    def __init__(
        self, job: PreparedJob, store: JobStore, console: TextIO | None = sys.stdout
    ) -> None:
        self.job = job
        self.store = store
        self.console = console
        self.name = job.spec.job_name
        self.folder = JobFolder.for_job(self.name)
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        if self.console is not None:
            elapsed = time.monotonic() - self.started
            stamp = time.strftime("%H:%M:%S", time.gmtime(elapsed))
            self.console.write(f"[dtrain {self.name} {stamp}] {message}\n")
            self.console.flush()

    def transition(self, secondary: str, message: str, **columns: Any) -> None:
        self.store.update(self.name, secondary_status=secondary, message=message, **columns)
        self.say(f"{secondary}: {message}")

    def run(self) -> JobRecord:
        spec = self.job.spec
        if self.folder.root.exists():
            raise DtrainError(
                f"job folder {self.folder.root} already exists; choose another job name"
            )
        # Record the resolved layout, so `dtrain jobs` and `describe` show what actually ran.
        resolved = dataclasses.replace(
            spec, processes_per_host=self.job.distribution.processes_per_host
        )
        self.store.create(self.name, resolved.to_json(), self.folder.root)
        self.store.update(self.name, supervisor_pid=os.getpid(), start_time=time.time())
        try:
            self._lay_out()
            outcome = self._train()
            self._finish(outcome)
        except DtrainError as error:
            # e.g. a channel that cannot be downloaded: the job fails, with the reason recorded.
            self._end(FAILED, "Failed", str(error), failure_reason=str(error))
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt):
                self._end(STOPPED, "Stopped", "Interrupted")
            else:
                reason = f"internal error: {type(error).__name__}: {error}"
                self._end(FAILED, "Failed", reason, failure_reason=reason)
            raise
        return self.store.get(self.name)

    def _lay_out(self) -> None:
        spec = self.job.spec
        plan = self._launch_plan(port=0)
        self.folder.logs_dir.mkdir(parents=True)
        _copy_code(spec, self.folder.code_dir)
        self.folder.spec_file.write_text(spec.to_json())
        if spec.checkpoint_local_path:  # shared by the hosts, as a checkpoint volume would be
            Path(spec.checkpoint_local_path).mkdir(parents=True, exist_ok=True)
        self.transition("Downloading", "Downloading input data")
        for host_index in range(spec.instance_count):
            host = self.folder.host(host_index)
            host.create()
            for channel in spec.channels:
                materialize_channel(
                    channel, host.channel_dir(channel.name), host_index, spec.instance_count
                )
            plan.write_host_config(host_index)

    def _launch_plan(self, port: int) -> LaunchPlan:
        return LaunchPlan(
            spec=self.job.spec,
            distribution=self.job.distribution,
            folder=self.folder,
            gpus_per_host=self.job.gpus_per_host,
            master_port=port,
            hyperparameters=self.job.hyperparameters,
        )

    def _train(self) -> Outcome:
        import torch.distributed as dist

        spec = self.job.spec
        attempts = spec.max_retry_attempts + 1
        for attempt in range(1, attempts + 1):
            listener = _free_loopback_listener()
            port = listener.getsockname()[1]
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                None,
                True,
                RENDEZVOUS_TIMEOUT,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
            plan = self._launch_plan(port)
            layout = f"{spec.instance_count} host(s) x {plan.processes_per_host} process(es)"
            self.transition("Training", f"Training on {layout}, attempt {attempt} of {attempts}")
            outcome = self._supervise(plan)
            del store
            retry = (
                outcome.status == FAILED
                and outcome.failure is not None
                and outcome.failure.signal_name is not None
                and attempt < attempts
            )
            if not retry:
                return outcome
            self.transition("Restarting", f"{outcome.message}; retrying")
        raise AssertionError("unreachable")

    def _supervise(self, plan: LaunchPlan) -> Outcome:
        extractor = MetricExtractor(validate_metric_definitions(self.job.spec.metric_definitions))
        argv = plan.command()

        def on_line(rank: int, line: str) -> None:
            if rank == 0:
                self.store.add_metrics(self.name, extractor.feed(line))

        last_check = [0.0]

        def should_stop() -> str | None:
            now = time.monotonic()
            if now - last_check[0] < 0.5:
                return None
            last_check[0] = now
            record = self.store.get(self.name)
            return "Stopped by request (dtrain stop)" if record.status == STOPPING else None

        launches = [
            RankLaunch(
                rank=rank,
                host=host_name(plan.host_index(rank)),
                argv=argv,
                env=plan.rank_env(rank),
                cwd=self.folder.code_dir,
                log_file=self.folder.log_file(rank),
            )
            for rank in range(plan.world_size)
        ]
        supervisor = Supervisor(
            launches,
            console=self.console,
            on_line=on_line,
            should_stop=should_stop,
            max_run=self.job.spec.max_run,
            on_progress=lambda elapsed: self.say("Training: in progress"),
        )
        return supervisor.run()

    def _finish(self, outcome: Outcome) -> None:
        if outcome.failure is not None:
            failure = outcome.failure
            host = self.folder.host(failure.rank // self.job.distribution.processes_per_host)
            host.failure_file.write_text(f"{failure.reason}\n\n{failure.tail}\n")
        artifacts = None
        if outcome.status in (COMPLETED, STOPPED):
            self.transition("Uploading", "Uploading generated training model")
            hosts = [self.folder.host(i) for i in range(self.job.spec.instance_count)]
            artifacts = upload_artifacts(
                self.name,
                self.job.output_url,
                [h.model_dir for h in hosts],
                [h.output_data_dir for h in hosts],
            )
        self._end(
            outcome.status,
            outcome.secondary_status,
            outcome.message,
            failure_reason=outcome.failure.reason if outcome.failure else None,
            model_artifacts=artifacts,
        )

    def _end(self, status: str, secondary: str, message: str, **columns: Any) -> None:
        self.store.update(
            self.name,
            status=status,
            secondary_status=secondary,
            message=message,
            end_time=time.time(),
            **columns,
        )
        self.say(f"{status}: {message}")


def run_job(
    spec: JobSpec, store: JobStore | None = None, console: TextIO | None = sys.stdout
) -> JobRecord:
    """Validate, then run ``spec`` to its end in this process (which exists to supervise it)."""
    prepared = prepare(spec)
    return JobRun(prepared, store or JobStore(), console).run()

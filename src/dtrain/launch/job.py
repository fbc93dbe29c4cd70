"""A training job from request to final status: validate, gather hosts, lay them out, train, upload.

The process that runs this is the job's controller, its single source of truth: it records every
status change, writes every rank's output to the job folder as it arrives, extracts metrics,
decides each attempt's end (:mod:`outcome`) and packs one ``model.tar.gz`` from every host's
``model/``. The hosts' work is done by their agents (:mod:`agent`), wherever the cluster found
them (:mod:`clusters`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import secrets
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse
from urllib.request import url2pathname

from dtrain.config.distribution import DistributionPlan, resolve_distribution
from dtrain.errors import ConfigError, DtrainError, did_you_mean
from dtrain.jobs.channels import validate_channels
from dtrain.jobs.folder import JOB_NAME_PATTERN, JobFolder, create_private_file, dtrain_home
from dtrain.jobs.limits import (
    check_names,
    check_nesting,
    check_no_nul,
    check_private_folder,
    check_process_size,
    check_s3_ready,
    check_seconds,
    check_writable_folder,
)
from dtrain.jobs.live import RATE_WINDOW, latest
from dtrain.jobs.logs import RankLogWriter, rank_label
from dtrain.jobs.metrics import MetricExtractor, MetricSample, validate_metric_definitions
from dtrain.jobs.modules import module_file
from dtrain.jobs.spec import JobSpec
from dtrain.jobs.store import COMPLETED, FAILED, STOPPED, STOPPING, JobRecord, JobStore
from dtrain.jobs.tensorboard import (
    METRICS_RUN,
    MetricEvents,
    publish,
    validate_tensorboard_output_config,
)
from dtrain.launch.artifacts import resolve_output_path, upload_artifacts
from dtrain.launch.clusters import AgentJob, Cluster, parse_cluster
from dtrain.launch.console import Console
from dtrain.launch.controller import Controller, JobStopped
from dtrain.launch.env import Host, LaunchPlan
from dtrain.launch.machine import visible_gpus
from dtrain.launch.outcome import Attempt, Outcome
from dtrain.launch.transfer import files_under, send_folder
from dtrain.launch.wire import Connection, shown
from dtrain.progress import Ticker, byte_bar, is_terminal
from dtrain.topology import host_name

LOCAL_INSTANCE_TYPES = ("local", "local_cpu", "local_gpu")


_NAME_STAMP = "-%Y-%m-%d-%H-%M-%S-%f"
"""What :func:`default_job_name` adds to a base, to the millisecond: ``%f``'s microseconds but
their last three digits."""
_NAME_STAMP_LENGTH = len("-YYYY-MM-DD-HH-MM-SS-mmm")


def default_job_name(base: str) -> str:
    """SageMaker's naming: ``<base>-YYYY-MM-DD-HH-MM-SS-mmm``.

    The base is cleaned to the allowed characters.
    """
    base = re.sub(r"[^a-zA-Z0-9-]+", "-", base).strip("-")[:32] or "job"
    return base + _name_stamp(datetime.datetime.now())


def _name_stamp(moment: datetime.datetime) -> str:
    return moment.strftime(_NAME_STAMP)[:-3]


def generated_base(name: str) -> str:
    """The base :func:`default_job_name` made ``name`` of; ``name`` itself if it made none.

    A stamp is one only if it reads back as written (``strptime`` alone takes ``-1`` for
    ``-01``)."""
    base, stamp = name[:-_NAME_STAMP_LENGTH], name[-_NAME_STAMP_LENGTH:]
    try:
        moment = datetime.datetime.strptime(stamp, _NAME_STAMP)
    except ValueError:
        return name
    return base if base and _name_stamp(moment) == stamp else name


def validate_instance_type(instance_type: str) -> None:
    if instance_type in LOCAL_INSTANCE_TYPES:
        return
    hint = (
        "dtrain runs jobs on your own machines; use instance_type='local' (GPUs if present), "
        "'local_gpu' or 'local_cpu', instance_count for the number of hosts and cluster to say "
        "where they are"
    )
    raise ConfigError(
        "instance_type", instance_type, f"one of {', '.join(LOCAL_INSTANCE_TYPES)}; {hint}"
    )


def gpus_per_host(instance_type: str, instance_count: int, gpus: int) -> int:
    """A machine's ``gpus`` shared out between ``instance_count`` hosts; none for ``local_cpu``."""
    if instance_type == "local_cpu":
        return 0
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
    hyperparameters: dict[str, Any]
    output_url: str
    cluster: Cluster
    tensorboard_url: str | None
    """Where the job's TensorBoard runs are copied (``TensorBoardOutputConfig.S3OutputPath``)."""


def _check_code(spec: JobSpec) -> None:
    """The entry point exists (inside ``source_dir`` if given; a module there, with ``-m``), and
    no link leaves the code.

    The code travels to every host as it is, links as links: a link to a file outside the source
    dir would not exist there, or would expose that file to the job.
    """
    if spec.module and spec.source_dir is None:
        raise ConfigError("source_dir", None, "the folder holding the -m module, e.g. '.'")
    if spec.source_dir is not None:
        source = Path(spec.source_dir)
        if not source.is_dir():
            raise ConfigError("source_dir", spec.source_dir, "an existing directory")
        entry = module_file(source, spec.entry_point) if spec.module else source / spec.entry_point
        if Path(spec.entry_point).is_absolute() or not _holds(source.resolve(), entry.resolve()):
            raise ConfigError(
                "entry_point", spec.entry_point, "a path relative to source_dir, inside it"
            )
    else:
        entry = Path(spec.entry_point)
    if not entry.is_file():
        where = f" inside source_dir {spec.source_dir!r}" if spec.source_dir else ""
        parent = entry.parent
        near = [path.name for path in parent.iterdir() if path.is_file()] if parent.is_dir() else []
        found = did_you_mean(entry.name, near)
        suggestion = str(Path(spec.entry_point).with_name(found)) if found else None
        raise ConfigError("entry_point", spec.entry_point, f"an existing file{where}", suggestion)
    folder, skip = _code_filter(spec)
    root = Path(os.path.realpath(folder))
    for path in files_under(folder, skip):
        if path.is_symlink() and not _holds(root, Path(os.path.realpath(path))):
            raise ConfigError(
                "source_dir",
                str(path),
                f"links that stay inside the source dir ({path} points to {os.readlink(path)})",
            )


def _holds(folder: Path, path: Path) -> bool:
    return folder == path or folder in path.parents


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
    check_seconds("max_run", spec.max_run)
    if not isinstance(spec.max_retry_attempts, int) or not 0 <= spec.max_retry_attempts <= 30:
        raise ConfigError("max_retry_attempts", spec.max_retry_attempts, "an integer from 0 to 30")
    _check_code(spec)
    cluster = parse_cluster(spec)
    check_seconds("join_timeout", spec.join_timeout)
    # The hosts of a local job share this machine's GPUs; other hosts report theirs on joining.
    local = spec.cluster == "local"
    visible = len(visible_gpus()) if local else 0
    gpus = gpus_per_host(spec.instance_type, spec.instance_count, visible)
    plan = resolve_distribution_for(spec, gpus)
    validate_metric_definitions(spec.metric_definitions)
    validate_channels(spec.channels)
    _check_values(spec, local)
    hyperparameters = {**spec.hyperparameters, **plan.framework_hyperparameters}
    job = PreparedJob(
        spec,
        plan,
        hyperparameters,
        _output_url("output_path", spec.output_path),
        cluster,
        _tensorboard_url(spec.tensorboard_output_config),
    )
    _check_rank_size(job)
    return job


def _output_url(key: str, path: str | None) -> str:
    """An output path (the value of ``key``) as a URL the controller can write to: S3 with
    credentials, or a folder of this user's."""
    url = resolve_output_path(path, key)
    if url.startswith("s3://"):
        check_s3_ready(key, url)
    else:
        check_private_folder(key, url2pathname(urlparse(url).path))
    return url


def _tensorboard_url(config: dict[str, str] | None) -> str | None:
    """``TensorBoardOutputConfig.S3OutputPath`` as a URL, checked as the output path is."""
    if config is None:
        return None
    validate_tensorboard_output_config(config)
    if config.get("S3OutputPath") is None:
        return None
    return _output_url("tensorboard_output_config.S3OutputPath", config["S3OutputPath"])


def _check_values(spec: JobSpec, local: bool) -> None:
    """Names, text and nesting a process can take; S3 and folders usable from here."""
    check_names("environment", spec.environment, "variable")
    for key, value in spec.environment.items():
        if not isinstance(value, str):
            raise ConfigError(f"environment.{key}", value, "a string")
    check_no_nul("environment", spec.environment)
    check_names("hyperparameters", spec.hyperparameters, "hyperparameter")
    check_nesting("hyperparameters", spec.hyperparameters)
    check_no_nul("hyperparameters", spec.hyperparameters)
    check_no_nul("script_args", spec.script_args)
    check_nesting("distribution", spec.distribution)
    if local:  # hosts elsewhere reach their data and folders with their own rights
        for channel in spec.channels:
            if channel.uri.startswith("s3://"):
                check_s3_ready(f"channels.{channel.name}.uri", channel.uri)
        if spec.checkpoint_local_path:
            check_writable_folder("checkpoint_local_path", spec.checkpoint_local_path)
            check_private_folder("checkpoint_local_path", spec.checkpoint_local_path)


def _check_rank_size(job: PreparedJob) -> None:
    """The ranks' environment and command line fit what Linux lets a process start with."""
    placeholder = Host("algo-1", "127.0.0.1", "lo", "", "", 1, [], str(dtrain_home()), 0)
    hosts = (placeholder,) * job.spec.instance_count
    plan = LaunchPlan(job.spec, job.distribution, hosts, job.hyperparameters)
    check_process_size(plan.rank_env(0, 1, 1), plan.arguments, job.spec.environment)


def resolve_distribution_for(spec: JobSpec, gpus: int) -> DistributionPlan:
    """The job's distribution with hosts of ``gpus`` GPUs each (one process per GPU by default).

    More processes than GPUs only for model parallelism, whose ranks share GPUs (``smp.init``
    then makes a gloo world: pp=2 on one GPU); elsewhere two ranks on one GPU fail in NCCL, or
    compute on the same GPU unknowingly.
    """
    plan = resolve_distribution(
        spec.distribution,
        instance_count=spec.instance_count,
        processes_per_host=spec.processes_per_host,
        default_processes_per_host=max(gpus, 1),
        instance_type=spec.instance_type,
    )
    sharing = plan.strategy == "smdistributed.modelparallel"
    if gpus and plan.processes_per_host > gpus and not sharing:
        raise ConfigError(
            "processes_per_host",
            plan.processes_per_host,
            f"at most the {gpus} GPU(s) each host has (one process per GPU; only model-parallel "
            "jobs run ranks that share a GPU)",
        )
    return plan


def _code_filter(spec: JobSpec) -> tuple[Path, Any]:
    """The folder sent as the job's code (as SageMaker's ``sourcedir.tar.gz``), and what to skip.

    dtrain's home may lie inside the source dir (a project folder holding both): it is left out,
    or a local job would copy its own copy. ``__pycache__`` folders are left out too.
    """
    home = Path(os.path.realpath(dtrain_home()))

    def skip(path: Path) -> bool:
        return path.name == "__pycache__" or _holds(home, Path(os.path.realpath(path)))

    if spec.source_dir is not None:
        return Path(spec.source_dir), skip
    entry = Path(spec.entry_point)
    return entry.parent, lambda path: path.name != entry.name


class JobRun:
    """Runs one prepared job, recording every status change in the store."""

    STATUS_EVERY = 15.0
    """Seconds between the status lines (latest metric, step rate) a terminal gets in training."""

    def __init__(
        self,
        job: PreparedJob,
        store: JobStore,
        console: TextIO | None = sys.stdout,
        on_folder: Callable[[JobFolder], None] | None = None,
    ) -> None:
        """``on_folder`` is called once the job is recorded and its ``logs/`` exists."""
        salted = dataclasses.replace(job.spec.with_absolute_paths(), key_salt=secrets.token_hex(16))
        self.job = dataclasses.replace(job, spec=salted)
        self.store = store
        self.console = Console(console) if console is not None else None
        self.terminal = console if is_terminal(console) else None
        """The console's stream where a person watches it: progress bars and status lines."""
        self.on_folder = on_folder
        self.name = job.spec.job_name
        self.folder = JobFolder.for_job(self.name)
        self.started = time.monotonic()
        self.extractor = MetricExtractor(validate_metric_definitions(job.spec.metric_definitions))
        self.metric_events = MetricEvents(self.folder.tensorboard_dir / METRICS_RUN)
        self._recent: dict[str, deque[MetricSample]] = {}  # each metric's last samples
        self._recent_lock = threading.Lock()
        self._secondary = "Starting"
        self._copy_bars: dict[tuple[str, str], Any] = {}  # (host, channel): its tqdm bar
        self._console_lock = threading.Lock()
        self._logs = RankLogWriter(self.folder)
        self._signalled: str | None = None
        self._signals = 0
        self._journal: TextIO | None = None
        self._last_stop_check = 0.0
        self._stop_requested = False
        self._training_since: float | None = None  # --max-run counts from the first training

    def _stamp(self) -> str:
        """Time since the job was submitted, as each console line shows it."""
        return time.strftime("%H:%M:%S", time.gmtime(time.monotonic() - self.started))

    def say(self, message: str) -> None:
        """To the console (unless quiet) and, always, to the job's ``logs/controller.log``."""
        stamp = self._stamp()
        with self._console_lock:
            if self._journal is not None:
                now = datetime.datetime.now().isoformat(timespec="milliseconds")
                self._journal.write(f"{now} {message}\n")
                self._journal.flush()
            if self.console is not None:
                self.console.write([f"[dtrain {self.name} {stamp}] {message}"])

    def transition(self, secondary: str, message: str, **columns: Any) -> None:
        self.store.update(self.name, secondary_status=secondary, message=message, **columns)
        self._secondary = secondary
        self.say(f"{secondary}: {message}")

    def _say_status(self) -> None:
        """A training job's latest metric and step rate, to the console only (a terminal's: see
        :class:`~dtrain.progress.Ticker`); the log has the lines they come from."""
        if self._secondary != "Training" or self.console is None:
            return
        with self._recent_lock:
            now = latest([sample for samples in self._recent.values() for sample in samples])
        self.console.write(
            [f"[dtrain {self.name} {self._stamp()}] Training: {now or 'no metric yet'}"]
        )

    def run(self) -> JobRecord:
        spec = self.job.spec
        if self.folder.root.exists():
            raise DtrainError(
                f"job folder {self.folder.root} already exists; choose another job name"
            )
        cluster = self.job.cluster
        listener = cluster.open(spec.instance_count)  # a bad address or cluster: no record yet
        secret = cluster.secret()
        # Record the resolved layout and output path, so `dtrain jobs` and `describe` show what
        # actually ran.
        resolved = dataclasses.replace(
            spec,
            processes_per_host=self.job.distribution.processes_per_host,
            output_path=self.job.output_url,
        )
        self.store.create(self.name, resolved.to_json(), self.folder.root)
        self.store.update(self.name, supervisor_pid=os.getpid(), start_time=time.time())
        self.folder.logs_dir.mkdir(parents=True)
        if self.on_folder is not None:
            self.on_folder(self.folder)
        self._journal = self.folder.controller_log_file.open("a", encoding="utf-8")
        previous = self._install_signal_handlers()
        controller = Controller(
            listener,
            secret,
            cluster,
            self._on_output,
            self.say,
            self._should_stop,
            self._on_copied if self.terminal else None,
        )
        ticker = Ticker(self.terminal, self.STATUS_EVERY, self._say_status)
        ticker.start()
        try:
            create_private_file(self.folder.spec_file)
            self.folder.spec_file.write_text(spec.to_json())
            names = [host_name(i) for i in range(spec.instance_count)]
            agents = AgentJob(listener.getsockname()[:2], secret, self.folder, self.say)

            def start(hosts: list[str]) -> None:
                cluster.start_agents(hosts, agents)

            start(names)
            plan = self._plan(controller.gather(names, cluster.join_timeout))
            self.transition("Downloading", "Downloading input data")
            source, skip = _code_filter(spec)

            def code(connection: Connection, check: Callable[[], None]) -> None:
                send_folder(connection, "code", source, skip, check)

            controller.prepare(plan, code)
            outcome, plan = self._train(controller, plan, start, code)
            self._finish(outcome, controller, plan)
        except JobStopped as stop:
            self._end(STOPPED, stop.secondary_status, str(stop))
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
        finally:
            ticker.stop()
            for bar in self._copy_bars.values():
                bar.close()
            controller.close()
            cluster.close()
            self._restore_signal_handlers(previous)
            self._logs.close()
            self.metric_events.close()
            with self._console_lock:
                self._journal.close()
                self._journal = None
        return self.store.get(self.name)

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def interrupt(signum: int, _frame: object) -> None:
            self._signalled = f"Interrupted by {signal.Signals(signum).name}"
            self._signals += 1

        return {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _should_stop(self) -> tuple[str, str] | None:
        """Ctrl-C or SIGTERM, ``dtrain stop`` (read twice a second), ``--max-run`` of training."""
        if self._signalled:
            return "Stopped", self._signalled
        over = self._over_max_run()
        if over is not None:
            return over
        now = time.monotonic()
        if now - self._last_stop_check >= 0.5:
            self._last_stop_check = now
            self._stop_requested = self.store.get(self.name).status == STOPPING
        if self._stop_requested:
            return "Stopped", "Stopped by request (dtrain stop)"
        return None

    def _over_max_run(self) -> tuple[str, str] | None:
        """``--max-run`` counts from the first training; the stop it asks for, once passed."""
        since, limit = self._training_since, self.job.spec.max_run
        if since is None or time.monotonic() - since <= limit:
            return None
        return "MaxRuntimeExceeded", f"Training job exceeded MaxRuntimeInSeconds ({limit:g} s)"

    def _new_stop_check(self) -> Callable[[], None]:
        """A check that raises JobStopped for a stop made after this call only: a Ctrl-C,
        SIGTERM or ``dtrain stop``, or ``--max-run`` passing.

        The results are collected after the stop that ended training (Stopped jobs keep what
        ``model/`` holds), but another stop during the collection gives up.
        """
        signals, requested = self._signals, self._stop_requested
        over = self._over_max_run() is not None

        def check() -> None:
            self._should_stop()  # refreshes the store's stop request
            if self._signals > signals:
                raise JobStopped("Stopped", self._signalled or "Interrupted")
            if self._stop_requested and not requested:
                raise JobStopped("Stopped", "Stopped by request (dtrain stop)")
            passed = self._over_max_run()
            if passed is not None and not over:
                raise JobStopped(*passed)

        return check

    def _on_output(
        self, host: str, attempt: int, rank: int, lines: list[list[Any]], frame: str | None
    ) -> None:
        """Rank output as it arrives (one reader thread per host): log, console, metrics."""
        self._logs.write(attempt, rank, [(when, line) for when, line in lines])
        if self.console is not None:
            label = rank_label(host, rank)
            self.console.write(
                (f"{label}: {line}" for _, line in lines),
                owner=rank,
                frame=f"{label}: {frame}" if frame is not None else None,
            )
        if rank == 0:
            samples = [sample for _, line in lines for sample in self.extractor.feed(line)]
            self.store.add_metrics(self.name, samples)
            self.metric_events.add(samples)
            with self._recent_lock:
                for sample in samples:
                    self._recent.setdefault(sample.name, deque(maxlen=RATE_WINDOW)).append(sample)

    def _on_copied(self, host: str, channel: str, done: int, total: int, final: bool) -> None:
        """A bar per host and channel while the hosts copy their channels (on a terminal only:
        agents report their copies only then)."""
        key = (host, channel)
        bar = self._copy_bars.get(key)
        if bar is None:
            description = f"{host} {shown(channel, 64)}"
            bar = self._copy_bars[key] = byte_bar(description, total or None, self.terminal)
        if final:
            bar.total = done
        bar.update(done - bar.n)
        if final:
            bar.close()
            del self._copy_bars[key]

    def _plan(self, hosts: list[Host]) -> LaunchPlan:
        """The launch plan for the hosts that joined, and their record in the store."""
        spec = self.job.spec
        self.store.set_hosts(self.name, [dataclasses.asdict(host) for host in hosts])
        distribution = self.job.distribution
        plan = LaunchPlan(spec, distribution, tuple(hosts), self.job.hyperparameters)
        gpus = plan.gpus_per_host
        if spec.instance_type == "local_gpu" and gpus == 0:
            raise DtrainError(
                "instance_type 'local_gpu' needs at least one GPU per host; the hosts have "
                + ", ".join(f"{h.name}: {len(h.gpus)}" for h in hosts)
            )
        if spec.cluster != "local":  # the default processes per host follow the hosts' GPUs
            distribution = resolve_distribution_for(spec, gpus)
            plan = dataclasses.replace(plan, distribution=distribution)
        for machine in {host.machine for host in hosts}:
            sharing = [host for host in hosts if host.machine == machine]
            ranks = len(sharing) * plan.processes_per_host
            if ranks > sharing[0].cpus:
                self.say(
                    f"{ranks} processes on the {sharing[0].cpus} cores of "
                    f"{shown(sharing[0].hostname, 100)} "
                    f"({', '.join(h.name for h in sharing)}): oversubscribed, each runs slower"
                )
        return plan

    def _train(
        self,
        controller: Controller,
        plan: LaunchPlan,
        start: Callable[[list[str]], None],
        code: Callable[[Connection, Callable[[], None]], None],
    ) -> tuple[Outcome, LaunchPlan]:
        """Every attempt, each on a fresh rendezvous; lost hosts are replaced before a retry."""
        spec = self.job.spec
        attempts = spec.max_retry_attempts + 1
        for number in range(1, attempts + 1):
            lost = controller.lost_hosts()
            if lost:
                self.say(f"replacing lost host(s) {', '.join(lost)}")
                controller.forget(lost)
                start(lost)
                plan = self._plan(controller.gather(plan.host_names, self.job.cluster.join_timeout))
                controller.prepare(plan, code, hosts=lost)
            port = controller.open_store(number, plan.hosts[0].name)
            if self._training_since is None:
                self._training_since = time.monotonic()
            layout = f"{len(plan.hosts)} host(s) x {plan.processes_per_host} process(es)"
            self._logs.start_attempt(
                number,
                {rank: plan.host_names[plan.host_index(rank)] for rank in range(plan.world_size)},
            )
            self.transition("Training", f"Training on {layout}, attempt {number} of {attempts}")
            outcome = controller.run_attempt(Attempt(number, tuple(plan.host_names)), plan, port)
            controller.close_store(number, plan.hosts[0].name)
            if not (outcome.retryable and number < attempts):
                return outcome, plan
            self.transition("Restarting", f"{outcome.message}; retrying")
        raise AssertionError("unreachable")

    def _finish(self, outcome: Outcome, controller: Controller, plan: LaunchPlan) -> None:
        if outcome.failure is not None:
            failure = outcome.failure
            index = plan.host_names.index(failure.host)
            failure_file = self.folder.host(index).failure_file
            failure_file.parent.mkdir(parents=True, exist_ok=True)
            failure_file.write_text(f"{failure.reason}\n\n{failure.tail}\n")
        check = self._new_stop_check()  # one for the whole collection: a stop ends it all
        artifacts = None
        try:
            self._collect_tensorboard(controller, plan, check)
            if outcome.status in (COMPLETED, STOPPED):
                self.transition("Uploading", "Uploading generated training model")
                artifacts = upload_artifacts(
                    self.name,
                    self.job.output_url,
                    lambda stream, target: controller.collect(
                        stream, plan.host_names, target, check
                    ),
                    self.terminal,
                )
        except JobStopped as stop:
            if outcome.status != FAILED:
                raise
            self.say(f"TensorBoard events not collected: {stop}")  # the failure stays the news
        self._end(
            outcome.status,
            outcome.secondary_status,
            outcome.message,
            failure_reason=outcome.failure.reason if outcome.failure else None,
            model_artifacts=artifacts,
        )

    def _collect_tensorboard(
        self, controller: Controller, plan: LaunchPlan, check: Callable[[], None]
    ) -> None:
        """Each host's TensorBoard events into ``tensorboard/<host>/``, whatever the outcome
        (a failed job's curves are what one looks at), then to ``S3OutputPath`` if given.

        A host that cannot send its events (lost, stalled, a file that cannot be written) is
        named on the console, and the job goes on: its status is decided by its ranks, and its
        model is collected as if nothing happened. A stop request ends the collection.
        """
        for name in plan.host_names:
            try:
                controller.fetch("tensorboard", name, self.folder.tensorboard_dir / name, check)
            except JobStopped:
                raise
            except DtrainError as error:
                self.say(f"TensorBoard events not collected: {error}")
        url = self.job.tensorboard_url
        if url is not None and self.folder.tensorboard_dir.is_dir():
            try:
                copied = publish(self.folder.tensorboard_dir, url, self.name)
            except OSError as error:
                self.say(f"TensorBoard events not copied to {url}: {error}")
            else:
                self.say(f"TensorBoard events copied to {copied}")

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
    spec: JobSpec,
    store: JobStore | None = None,
    console: TextIO | None = sys.stdout,
    on_folder: Callable[[JobFolder], None] | None = None,
) -> JobRecord:
    """Validate, then run ``spec`` to its end in this process (its controller)."""
    prepared = prepare(spec)
    return JobRun(prepared, store or JobStore(), console, on_folder).run()

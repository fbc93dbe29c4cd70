"""The ``dtrain`` command: run training jobs, look at them afterwards, plan model partitions."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from dtrain.errors import ConfigError, DtrainError, did_you_mean

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_STOPPED = 3
EXIT_CODES = {"Completed": EXIT_OK, "Failed": EXIT_FAILED, "Stopped": EXIT_STOPPED}


def _json_arg(flag: str, text: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(flag, text, f"JSON ({error.msg} at position {error.pos})") from None
    except RecursionError:
        raise ConfigError(flag, text[:40] + "...", "JSON nested less deeply") from None
    if not isinstance(value, kind):
        raise ConfigError(flag, value, f"a JSON {'object' if kind is dict else 'array'}")
    return value


def _key_value(flag: str, text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(flag, text, "KEY=VALUE")
    return key, value


class _Version(argparse.Action):
    """``--version``: dtrain's, torch's and Python's versions, read from the installed packages'
    metadata when asked for (importing torch takes seconds)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **_: Any) -> None:
        super().__init__(
            option_strings, dest, nargs=0, help="print the versions of dtrain, torch and Python"
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib.metadata import version

        python = ".".join(map(str, sys.version_info[:3]))
        print(f"dtrain {version('dtrain')} (torch {version('torch')}, Python {python})")
        parser.exit()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtrain",
        description=(
            "Run distributed PyTorch scripts as SageMaker-style training jobs, on this machine "
            "or across machines."
        ),
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run a script or module as a training job and wait for it (or --detach)",
        usage="dtrain run [FLAGS] (SCRIPT | -m MODULE) [-- SCRIPT_ARGS...]",
        epilog="Arguments after -- go to the script on every rank, after the hyperparameters' "
        "(--key value), so that argparse lets them win.",
    )
    run.add_argument(
        "entry_point",
        nargs="?",
        metavar="SCRIPT",
        help="the training script (relative to --source-dir if given)",
    )
    run.add_argument(
        "-m",
        "--module",
        metavar="MODULE",
        help="run a module of --source-dir as `python -m` does (e.g. pkg.train), not a script",
    )
    run.set_defaults(script_args=[])
    run.add_argument("--instance-count", type=int, default=1, help="hosts algo-1..N")
    run.add_argument("--processes-per-host", type=int, help="default: GPUs per host, else 1")
    run.add_argument("--instance-type", default="local", help="local, local_cpu or local_gpu")
    run.add_argument(
        "--distribution", help="SageMaker distribution config: JSON text or a JSON file"
    )
    run.add_argument("--hyperparameters", default="{}", help="JSON object, passed as --key value")
    run.add_argument(
        "--channel",
        action="append",
        default=[],
        metavar="NAME=URI[,OPTION=VALUE]",
        help="input channel: local path, file:// or s3:// (repeatable); options "
        "distribution=ShardedByS3Key|FullyReplicated (each host gets its share of the files, or "
        "all of them: the default) and content_type=TYPE",
    )
    run.add_argument("--source-dir", help="directory copied as the job's code (cwd of each rank)")
    run.add_argument("--job-name", help="default: <base-job-name>-<timestamp>")
    run.add_argument("--base-job-name", help="prefix of the generated job name")
    run.add_argument("--max-run", type=float, default=24 * 60 * 60, help="seconds before Stopped")
    run.add_argument(
        "--max-retry-attempts", type=int, default=0, help="restarts after a rank is killed"
    )
    run.add_argument("--output-path", help="where model.tar.gz goes: path, file:// or s3://")
    run.add_argument("--checkpoint-local-path", help="checkpoint directory shared by the hosts")
    run.add_argument("--metric-definitions", default="[]", help='JSON [{"Name":..., "Regex":...}]')
    run.add_argument(
        "--tensorboard-output-path",
        metavar="URI",
        help="copy the job's TensorBoard events (metrics and the ranks' own) to "
        "URI/<job>/tensorboard-output: a path, file:// or s3:// "
        "(TensorBoardOutputConfig.S3OutputPath)",
    )
    run.add_argument(
        "--tensorboard-local-path",
        metavar="PATH",
        help="where ranks write TensorBoard events, under /opt/ml (default "
        "/opt/ml/output/tensorboard; TensorBoardOutputConfig.LocalPath)",
    )
    run.add_argument(
        "--environment", action="append", default=[], metavar="KEY=VALUE", help="(repeatable)"
    )
    run.add_argument(
        "--cluster",
        default="local",
        help="where the hosts are: local (this machine, default), join://ADDR:PORT (agents "
        "started with `dtrain agent --join` join here) or ray://ADDR:PORT (a Ray cluster)",
    )
    run.add_argument(
        "--secret-file", help="the job's secret for join:// (created, mode 0600, if missing)"
    )
    run.add_argument(
        "--join-timeout", type=float, default=600.0, help="seconds to wait for every host to join"
    )
    run.add_argument("--quiet", action="store_true", help="do not mirror rank output")
    _add_detach(run)

    agent = commands.add_parser("agent", help="run one machine's share of a job")
    agent.add_argument(
        "--join", required=True, metavar="ADDR:PORT", help="the controller's join:// address"
    )
    agent.add_argument(
        "--secret-file", required=True, help="the job's secret (- reads it from standard input)"
    )
    agent.add_argument(
        "--address",
        help="this machine's address for the job (default: the one that reaches the controller)",
    )
    agent.add_argument("--host", help="ask for this host name (algo-1 hosts the rendezvous)")
    agent.add_argument(
        "--connect-timeout",
        type=float,
        default=600.0,
        help="seconds to keep trying to join the controller (whatever it or a stranger answers)",
    )

    jobs = commands.add_parser("jobs", help="list jobs, newest first")
    jobs.add_argument("--status", help="only jobs of this status (InProgress, Completed, ...)")
    jobs.add_argument("--name-contains", metavar="TEXT", help="only jobs whose name has TEXT")
    jobs.add_argument("--max", type=int, default=20, help="at most this many (0: all)")

    describe = commands.add_parser("describe", help="a job as DescribeTrainingJob JSON")
    describe.add_argument("name")

    logs = commands.add_parser(
        "logs", help="print a job's logs, every rank's interleaved in time, [host,rank] first"
    )
    logs.add_argument("name")
    logs.add_argument("--rank", type=int, help="only this (global) rank")
    logs.add_argument("--attempt", type=int, help="only this attempt (default: every attempt)")
    logs.add_argument(
        "--follow", "-f", action="store_true", help="keep printing until the job ends"
    )
    logs.add_argument(
        "--timestamps", "-t", action="store_true", help="each line after its UTC time"
    )
    logs.add_argument("--tail", "-n", type=int, metavar="N", help="only the last N lines")

    stop = commands.add_parser("stop", help="stop a running job and wait until it has stopped")
    stop.add_argument("name")

    rerun = commands.add_parser("rerun", help="run a job's spec again, under a new name")
    rerun.add_argument("name")
    rerun.add_argument("--job-name", help="default: the old name's base and a new timestamp")
    rerun.add_argument("--quiet", action="store_true", help="do not mirror rank output")
    _add_detach(rerun)

    rm = commands.add_parser("rm", help="delete finished jobs: their folders and records")
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.add_argument("--force", action="store_true", help="stop running jobs first")

    prune = commands.add_parser("prune", help="delete the jobs that finished long ago")
    prune.add_argument(
        "--older-than",
        required=True,
        metavar="DURATION",
        help="jobs that ended this long ago or more: 7d, 12h, 1d12h, 30m, ...",
    )
    prune.add_argument("--dry-run", action="store_true", help="list them, delete nothing")

    metrics = commands.add_parser("metrics", help="a job's metric time series")
    metrics.add_argument("name")
    metrics.add_argument("--plot", metavar="OUT.png", help="write a plot of every metric")
    metrics.add_argument(
        "--format", help="table (default), csv or json: one row or object per sample, for scripts"
    )

    plan = commands.add_parser("plan", help="profile a model and print its partition plan")
    plan.add_argument(
        "model", metavar="FILE:FACTORY", help="Python file and its function returning the nn.Module"
    )
    plan.add_argument(
        "--input",
        default="sample_batch",
        metavar="[FILE:]FUNCTION",
        help="function returning example inputs: (args, kwargs), a tuple of args, or one "
        "argument (default: sample_batch in the model's file)",
    )
    plan.add_argument("--partitions", type=int, required=True, help="pipeline partitions")
    plan.add_argument(
        "--memory-weight", type=float, default=0.2, help="0..1, memory against compute balance"
    )
    plan.add_argument(
        "--repeats", type=int, help="timed passes (times are medians; default: as many as a job)"
    )
    plan.add_argument(
        "--without-memory",
        action="store_true",
        help="create the model without memory (as smp.delay_param_initialization does) and plan "
        "from its shapes and operation counts, untimed: for models larger than this machine",
    )
    plan.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="microbatches per step; the --input batch is one of them (default 1)",
    )
    plan.add_argument(
        "--pipeline", default="interleaved", help="the pipeline's schedule: interleaved, simple"
    )
    plan.add_argument(
        "--active-microbatches",
        type=int,
        help="most microbatches in flight (default: partitions + 2, at most --microbatches)",
    )
    plan.add_argument(
        "--optimizer",
        default="adam",
        help="whose state the memory per partition counts: adam (default), adamw, "
        "sgd-momentum, sgd",
    )
    precision = plan.add_mutually_exclusive_group()
    for name in ("fp16", "bf16"):
        precision.add_argument(
            f"--{name}",
            action="store_const",
            const=name,
            dest="half_precision",
            help=f"{name} parameters with fp32 masters (SMP's {name} parameter)",
        )
    plan.add_argument(
        "--memory-per-rank",
        metavar="SIZE",
        help="fail (exit 1) naming a layout that fits when a partition needs more, e.g. 8GiB",
    )
    plan.add_argument(
        "--max-partitions",
        type=int,
        help="most partitions the layout proposed by --memory-per-rank may have (default 8)",
    )
    plan.add_argument(
        "--depth",
        type=int,
        metavar="N",
        help="show N levels of the module tree, folding deeper modules into their row "
        "(default: fold below each unit the planner placed)",
    )
    plan.add_argument("--json", metavar="OUT.json", help="write the plan as JSON")
    plan.add_argument(
        "--png",
        metavar="OUT.png",
        help="draw each partition's predicted time, operations and peak memory (matplotlib)",
    )
    plan.add_argument(
        "--dot",
        metavar="OUT.dot",
        help="write the plan as Graphviz text (rendering it needs Graphviz, which dtrain does "
        "not install; --png draws without it)",
    )

    ui = commands.add_parser("ui", help="serve a read-only web view of the jobs")
    ui.add_argument("--port", type=int, default=8470, help="default 8470; 0 picks a free port")
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1); any other needs a token, made and "
        "printed unless --token-file gives it",
    )
    ui.add_argument(
        "--token-file", help="file holding the token every request must carry (- reads stdin)"
    )
    return parser


def _add_detach(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--detach",
        action="store_true",
        help="start the job in the background, print its name and return "
        "(dtrain logs -f NAME follows it, dtrain stop NAME stops it)",
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line; what follows ``--`` is ``dtrain run``'s script's."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = _build_parser()
    args, unknown = parser.parse_known_args(argv[:split])
    if unknown:
        hint = (
            " (arguments for the script go after --, e.g. dtrain run train.py -- --epochs 1)"
            if args.command == "run"
            else ""
        )
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if split < len(argv):
        if args.command != "run":
            parser.error(f"dtrain {args.command} takes no arguments after --")
        args.script_args = argv[split + 1 :]
    return args


def spec_from_args(args: argparse.Namespace) -> Any:
    """The ``dtrain run`` flags as a :class:`JobSpec`, every value checked for its form."""
    from dtrain.config.distribution import load_distribution
    from dtrain.jobs.channels import parse_channel_arg
    from dtrain.jobs.spec import JobSpec
    from dtrain.launch.job import default_job_name

    if (args.entry_point is None) == (args.module is None):
        given = f"{args.entry_point} and -m {args.module}" if args.module else "neither"
        raise ConfigError(
            "SCRIPT or -m MODULE", given, "one of them, e.g. train.py or -m pkg.train"
        )
    entry = args.module or args.entry_point
    base = args.module.rpartition(".")[2] if args.module else Path(entry).stem
    return JobSpec(
        entry_point=entry,
        module=args.module is not None,
        script_args=tuple(args.script_args),
        job_name=args.job_name or default_job_name(args.base_job_name or base),
        instance_count=args.instance_count,
        processes_per_host=args.processes_per_host,
        instance_type=args.instance_type,
        distribution=load_distribution(args.distribution) if args.distribution else None,
        hyperparameters=_json_arg("--hyperparameters", args.hyperparameters, dict),
        channels=tuple(parse_channel_arg(text) for text in args.channel),
        source_dir=args.source_dir,
        max_run=args.max_run,
        output_path=args.output_path,
        checkpoint_local_path=args.checkpoint_local_path,
        metric_definitions=tuple(_json_arg("--metric-definitions", args.metric_definitions, list)),
        environment=dict(_key_value("--environment", text) for text in args.environment),
        max_retry_attempts=args.max_retry_attempts,
        cluster=args.cluster,
        secret_file=args.secret_file,
        join_timeout=args.join_timeout,
        tensorboard_output_config=_tensorboard_config(args),
    )


def _tensorboard_config(args: argparse.Namespace) -> dict[str, str] | None:
    """The ``--tensorboard-*`` flags as SageMaker's ``TensorBoardOutputConfig``, if any is given."""
    config = {
        "S3OutputPath": args.tensorboard_output_path,
        "LocalPath": args.tensorboard_local_path,
    }
    config = {key: value for key, value in config.items() if value is not None}
    return config or None


def _run(spec: Any, quiet: bool, on_folder: Callable[[Any], None] | None = None) -> int:
    from dtrain.launch.job import run_job

    try:
        record = run_job(spec, console=None if quiet else sys.stdout, on_folder=on_folder)
    except KeyboardInterrupt:
        return EXIT_STOPPED
    if record.failure_reason:
        print(f"dtrain: job {record.name} failed: {record.failure_reason}", file=sys.stderr)
    if record.model_artifacts:
        print(f"dtrain: job {record.name} {record.status}; model: {record.model_artifacts}")
    return EXIT_CODES[record.status]


def _submit(spec: Any, quiet: bool, detach: bool) -> int:
    """Run ``spec`` here to its end, or detached: its name on standard output, at once."""
    if not detach:
        return _run(spec, quiet)
    from dtrain.launch.submit import start_detached

    detached = start_detached(spec)
    if not detached.started:
        sys.stderr.write(detached.said)
        return detached.status or EXIT_FAILED
    name = spec.job_name
    print(name)
    print(
        f"dtrain: job {name} runs in the background: dtrain logs -f {name} follows it, "
        f"dtrain stop {name} stops it",
        file=sys.stderr,
    )
    return EXIT_OK


def _rerun(args: argparse.Namespace) -> int:
    from dtrain.jobs.store import JobStore
    from dtrain.launch.submit import rerun_spec

    spec = rerun_spec(JobStore().get(args.name), args.job_name)
    return _submit(spec, args.quiet, args.detach)


def _rm(names: list[str], force: bool) -> int:
    from dtrain.jobs.cleanup import mebibytes, removable, remove
    from dtrain.jobs.store import JobStore

    store = JobStore()
    for record in removable(store, names, force):
        print(f"removed {record.name} ({record.status}, {mebibytes(remove(store, record))})")
    return EXIT_OK


def _prune(older_than: str, dry_run: bool) -> int:
    from dtrain.jobs.cleanup import mebibytes, parse_duration, prune
    from dtrain.jobs.store import JobStore

    total = count = 0
    verb = "would remove" if dry_run else "removed"
    for record, size in prune(JobStore(), parse_duration("--older-than", older_than), dry_run):
        ended = datetime.datetime.fromtimestamp(record.end_time or record.creation_time)
        print(f"{verb} {record.name} ({record.status} {ended:%Y-%m-%d %H:%M}, {mebibytes(size)})")
        total, count = total + size, count + 1
    freed = "would free" if dry_run else "freed"
    print(f"{count} job(s) ended more than {older_than} ago; {freed} {mebibytes(total)}")
    return EXIT_OK


def _jobs(status: str | None, name_contains: str | None, most: int) -> int:
    from dtrain.jobs.live import RATE_WINDOW, format_elapsed, latest
    from dtrain.jobs.store import STATUSES, JobStore, spec_dict

    if status is not None:
        _check_choice("--status", status, STATUSES)
    if most < 0:
        raise ConfigError("--max", most, "an integer >= 0 (0: every job)")
    store = JobStore()
    records = [
        record
        for record in store.list()
        if status in (None, record.status) and (name_contains or "") in record.name
    ]
    shown = records[:most] if most else records
    rows = [("NAME", "STATUS", "SECONDARY", "CREATED", "ELAPSED", "LAYOUT", "LATEST")]
    for record in shown:
        spec = spec_dict(record)
        end = record.end_time or (None if record.is_terminal else time.time())
        elapsed = format_elapsed(end - record.start_time) if end and record.start_time else "-"
        created = datetime.datetime.fromtimestamp(record.creation_time).strftime(
            "%Y-%m-%d %H:%M:%S"
        )
        layout = f"{spec['instance_count']}x{spec['processes_per_host'] or 'auto'}"
        last = latest(store.recent_metrics(record.name, RATE_WINDOW))
        row = (record.name, record.status, record.secondary_status, created, elapsed, layout)
        rows.append((*row, str(last) if last else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    if len(shown) < len(records):
        print(f"({len(records) - len(shown)} older not shown; --max 0 shows all)", file=sys.stderr)
    return EXIT_OK


def _logs(args: argparse.Namespace) -> int:
    from dtrain.jobs.folder import JobFolder
    from dtrain.jobs.logs import labelled_logs, print_logs, rank_logs
    from dtrain.jobs.store import JobStore

    name, rank, attempt = args.name, args.rank, args.attempt
    if args.tail is not None and args.tail < 0:
        raise ConfigError("--tail", args.tail, "an integer >= 0")
    store = JobStore()
    record = store.get(name)
    folder = JobFolder(Path(record.folder))

    def files() -> list[tuple[str, Path]]:
        return labelled_logs(folder.logs_dir, rank, attempt)

    if (rank is not None or attempt is not None) and not args.follow and not files():
        found = rank_logs(folder.logs_dir)
        key, value = ("--rank", rank) if rank is not None else ("--attempt", attempt)
        available = ", ".join(f"attempt {a} rank {r}" for a, r, _ in found) or "none yet"
        raise ConfigError(key, value, f"a rank and attempt of job {name} (logs: {available})")
    print_logs(
        files,
        sys.stdout,
        follow=args.follow,
        finished=lambda: store.get(name).is_terminal,
        timestamps=args.timestamps,
        tail=args.tail,
    )
    return EXIT_OK


def _stop(name: str) -> int:
    """As ``docker stop`` does: ask, say so, and return once the job has ended (its ranks
    stopped, what ``model/`` held uploaded), printing the status it ended in."""
    from dtrain.jobs.store import JobStore

    store = JobStore()
    store.request_stop(name)
    print(f"Stopping {name} ...", flush=True)
    try:
        record = store.wait(name)
    except KeyboardInterrupt:
        print(f"dtrain: {name} is still stopping (see dtrain jobs)", file=sys.stderr)
        return EXIT_STOPPED
    print(f"{name}: {record.status}")
    return EXIT_OK


def _agent(args: argparse.Namespace) -> NoReturn:
    """Serve the job, then end without the interpreter's teardown: ``algo-1``'s rendezvous store
    loaded torch, and tearing torch down took 1 to 3 s here, which the controller (and so
    ``dtrain run``) waited for at the end of every job."""
    from dtrain.launch.agent import run_agent
    from dtrain.launch.entry import end
    from dtrain.launch.netif import parse_endpoint
    from dtrain.launch.wire import read_secret

    controller = parse_endpoint("--join", args.join)
    secret = read_secret(args.secret_file)
    end(run_agent(controller, secret, args.address, args.host, args.connect_timeout))


def _metrics(name: str, plot: str | None, form: str | None) -> int:
    from dtrain.jobs.metrics import METRIC_FORMATS, format_metrics, plot_metrics
    from dtrain.jobs.store import JobStore

    if form is not None:
        _check_choice("--format", form, METRIC_FORMATS)
    store = JobStore()
    store.get(name)  # an unknown job is an error, not an empty table
    samples = store.metrics(name)
    sys.stdout.write(format_metrics(samples, form or "table"))
    if plot:
        if not samples:
            raise DtrainError(f"job {name} has no metrics to plot (see --metric-definitions)")
        plot_metrics(samples, plot, title=name)
        print(f"plot written to {plot}", file=sys.stderr if form else sys.stdout)
    return EXIT_OK


def _import_file(flag: str, spec: str, path: Path) -> ModuleType:
    from dtrain.compat import shim_pythonpath_entry

    if path.suffix != ".py" or not path.is_file():
        raise ConfigError(flag, spec, f"FILE:FUNCTION naming an existing Python file ({path})")
    module_spec = importlib.util.spec_from_file_location(f"_dtrain_plan_{path.stem}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses look their module up while it runs
    folder = str(path.parent.resolve())
    sys.path.insert(0, folder)  # so the file can import its neighbours
    shim = shim_pythonpath_entry()
    if shim is not None and shim not in sys.path:
        sys.path.append(shim)  # `import smdistributed...` works as it does in a job; stays
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def _load_function(
    flag: str, spec: str, files: dict[Path, ModuleType], default_file: Path | None = None
) -> tuple[Path, Callable[..., Any]]:
    """``FILE:FUNCTION`` (or ``FUNCTION`` of ``default_file``); each file is imported once."""
    file, _, name = spec.rpartition(":")
    path = Path(file) if file else default_file
    if path is None or not name:
        raise ConfigError(flag, spec, "FILE:FUNCTION, e.g. model.py:build_model")
    if path not in files:
        files[path] = _import_file(flag, spec, path)
    function = getattr(files[path], name, None)
    if not callable(function):
        names = sorted(
            key for key, value in vars(files[path]).items() if callable(value) and key[0] != "_"
        )
        raise ConfigError(
            flag, spec, f"a function of {path}: {', '.join(names)}", did_you_mean(name, names)
        )
    return path, function


def _example_inputs(value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample function's result as ``(args, kwargs)``."""
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], (tuple, list))
        and isinstance(value[1], dict)
    ):
        return tuple(value[0]), value[1]
    return (value if isinstance(value, tuple) else (value,)), {}


def _check_choice(flag: str, value: str, allowed: Collection[str]) -> None:
    """``value`` is one of ``allowed``, or a ``ConfigError`` listing them (and a near miss)."""
    if value not in allowed:
        raise ConfigError(flag, value, ", ".join(allowed), did_you_mean(value, allowed))


def _memory_settings(args: argparse.Namespace) -> Any:
    """The ``dtrain plan`` flags that decide memory per partition, checked for their form."""
    from dtrain.modelparallel.plan.memory import OPTIMIZER_STATES, MemorySettings
    from dtrain.modelparallel.scheduling.policy import PIPELINES

    _check_choice("--pipeline", args.pipeline, PIPELINES)
    _check_choice("--optimizer", args.optimizer, OPTIMIZER_STATES)
    if args.microbatches < 1:
        raise ConfigError("--microbatches", args.microbatches, "an integer >= 1")
    active = args.active_microbatches
    if active is not None and not 1 <= active <= args.microbatches:
        raise ConfigError(
            "--active-microbatches",
            active,
            f"an integer from 1 to --microbatches ({args.microbatches})",
        )
    return MemorySettings(
        optimizer=args.optimizer,
        half_precision=args.half_precision,
        pipeline=args.pipeline,
        microbatches=args.microbatches,
        active_microbatches=active,
    )


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Samples in the example inputs: the first dimension of the first tensor with one."""
    import torch

    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _plan(args: argparse.Namespace) -> int:
    from torch import nn

    from dtrain.modelparallel.api.placement import manual_placements
    from dtrain.modelparallel.deferred import delay_param_initialization
    from dtrain.modelparallel.errors import MemoryLimitError
    from dtrain.modelparallel.plan.fit import MAX_PARTITIONS, check_memory
    from dtrain.modelparallel.plan.memory import parse_size
    from dtrain.modelparallel.plan.planview import StageProgress, draw_plan
    from dtrain.modelparallel.plan.profile import (
        DEFAULT_REPEATS,
        profile_module,
        profile_without_memory,
    )
    from dtrain.modelparallel.plan.solver import auto_plan

    repeats = DEFAULT_REPEATS if args.repeats is None else args.repeats
    if args.partitions < 1:
        raise ConfigError("--partitions", args.partitions, "an integer >= 1")
    if args.depth is not None and args.depth < 0:
        raise ConfigError("--depth", args.depth, "an integer >= 0 (0: the root's row only)")
    if not 0.0 <= args.memory_weight <= 1.0:
        raise ConfigError("--memory-weight", args.memory_weight, "a number from 0 to 1")
    if repeats < 1:
        raise ConfigError("--repeats", repeats, "an integer >= 1")
    settings = _memory_settings(args)
    limit = (
        None
        if args.memory_per_rank is None
        else parse_size("--memory-per-rank", args.memory_per_rank)
    )
    max_partitions = MAX_PARTITIONS if args.max_partitions is None else args.max_partitions
    if max_partitions < args.partitions:
        raise ConfigError(
            "--max-partitions", max_partitions, f"an integer >= --partitions ({args.partitions})"
        )
    progress = StageProgress()
    try:
        progress.stage("importing the model file")
        files: dict[Path, ModuleType] = {}
        model_file, factory = _load_function("FILE:FACTORY", args.model, files)
        _, sample = _load_function("--input", args.input, files, default_file=model_file)
        progress.stage("creating the model")
        with delay_param_initialization(enabled=args.without_memory):
            model = factory()
        if not isinstance(model, nn.Module):
            returned = type(model).__name__
            raise ConfigError(
                "FILE:FACTORY", args.model, f"a function returning an nn.Module, not {returned}"
            )
        inputs, kwargs = _example_inputs(sample())
        # As a job plans: the same profile (repeats; from shapes and operation counts for a
        # model made without memory) and smp.partition placements as constraints.
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            profile = profile_without_memory(model, inputs, kwargs, progress=progress.passes)
        else:
            profile = profile_module(
                model, inputs, kwargs, repeats=repeats, progress=progress.passes
            )
        progress.stage("planning")
        fixed = manual_placements(model)
        plan = auto_plan(profile, args.partitions, memory_weight=args.memory_weight, fixed=fixed)
        plan = plan.with_memory(settings)
    finally:
        progress.done()
    print(plan.table(args.depth, folded=args.depth is None))
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
        print(f"plan written to {args.json}")
    if args.png:
        draw_plan(plan, args.png, title=f"{args.model}: {args.partitions} partitions")
        print(f"drawing written to {args.png}")
    if args.dot:
        Path(args.dot).write_text(plan.to_dot())
        print(
            f"graph written to {args.dot}: rendering it needs Graphviz, which dtrain does not "
            f"install (dot -Tsvg {args.dot} -o plan.svg); --png draws the plan without it"
        )
    if limit is not None:
        samples = _batch_size(inputs, kwargs)
        try:
            check_memory(
                plan,
                profile,
                limit,
                memory_weight=args.memory_weight,
                fixed=fixed,
                max_partitions=max_partitions,
                batch_size=None if samples is None else samples * args.microbatches,
            )
        except MemoryLimitError as error:
            print(f"dtrain: {error}", file=sys.stderr)
            return EXIT_FAILED
        print(f"every partition fits {args.memory_per_rank} per rank")
    return EXIT_OK


def _run_spec(argv: Sequence[str]) -> int:
    """``dtrain run-spec [--remove] FILE``: a job from a spec file (how ``Estimator.fit`` starts
    one); not listed in ``--help``, being for dtrain's own use."""
    from dtrain.jobs.spec import JobSpec

    parser = argparse.ArgumentParser(prog="dtrain run-spec")
    parser.add_argument("spec_file")
    parser.add_argument("--remove", action="store_true", help="delete the spec file once read")
    parser.add_argument(
        "--detached", action="store_true", help="output to the job folder once it exists"
    )
    args = parser.parse_args(argv)
    spec_file = Path(args.spec_file)
    spec = JobSpec.from_json(spec_file.read_text())
    if args.remove:
        spec_file.unlink()
    if args.detached:
        from dtrain.launch.submit import into_job_folder

        return _run(spec, quiet=True, on_folder=into_job_folder)
    return _run(spec, quiet=False)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except BrokenPipeError:  # `dtrain describe X | head`: the reader left, nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _main(argv: list[str]) -> int:
    args = _parse(argv) if argv[:1] != ["run-spec"] else None
    try:
        if args is None:
            return _run_spec(argv[1:])
        if args.command == "run":
            return _submit(spec_from_args(args), args.quiet, args.detach)
        if args.command == "rerun":
            return _rerun(args)
        if args.command == "rm":
            return _rm(args.names, args.force)
        if args.command == "prune":
            return _prune(args.older_than, args.dry_run)
        if args.command == "jobs":
            return _jobs(args.status, args.name_contains, args.max)
        if args.command == "describe":
            from dtrain.jobs.describe import describe
            from dtrain.jobs.store import JobStore

            print(json.dumps(describe(JobStore(), args.name), indent=2))
            return EXIT_OK
        if args.command == "logs":
            return _logs(args)
        if args.command == "agent":
            return _agent(args)
        if args.command == "stop":
            return _stop(args.name)
        if args.command == "metrics":
            return _metrics(args.name, args.plot, args.format)
        if args.command == "plan":
            return _plan(args)
        if args.command == "ui":
            from dtrain.ui.serve import serve

            return serve(args.host, args.port, args.token_file, sys.stdout)
    except DtrainError as error:
        print(f"dtrain: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())

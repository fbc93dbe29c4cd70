"""The ``dtrain`` command: run training jobs, look at them afterwards, plan model partitions."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dtrain.commands import plan as plan_command
from dtrain.errors import ConfigError, DtrainError, check_choice
from dtrain.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_STOPPED


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
        "--environment",
        action="append",
        default=[],
        metavar="KEY=VALUE|NAME",
        help="a variable of every rank (repeatable); NAME alone passes this shell's value, "
        "which, unlike KEY=VALUE, no other user sees in the process list: use it for "
        "credentials",
    )
    run.add_argument(
        "--environment-file",
        action="append",
        default=[],
        metavar="FILE",
        help="variables from FILE, in docker's --env-file format: NAME=VALUE lines taken "
        "literally, NAME alone for this shell's value, # comments (repeatable; "
        "--environment wins)",
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

    # Parsed by dtrain.launch.agent, which dtrain starts as python -m dtrain.launch.agent (see
    # _main); listed here for --help.
    commands.add_parser("agent", help="run one machine's share of a job", add_help=False)

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

    plan_command.add_arguments(
        commands.add_parser("plan", help="profile a model and print its partition plan")
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
    from dtrain.jobs.variables import job_variables
    from dtrain.launch.job import default_job_name

    if (args.entry_point is None) == (args.module is None):
        given = f"{args.entry_point} and -m {args.module}" if args.module else "neither"
        raise ConfigError(
            "SCRIPT or -m MODULE", given, "one of them, e.g. train.py or -m pkg.train"
        )
    entry = args.module or args.entry_point
    base = args.module.rpartition(".")[2] if args.module else Path(entry).stem
    variables = job_variables(args.environment, args.environment_file, os.environ)
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
        environment=variables.values,
        hidden_environment=variables.hidden,
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


def _submit(spec: Any, quiet: bool, detach: bool) -> int:
    """Run ``spec`` here to its end, or detached: its name on standard output, at once."""
    if not detach:
        from dtrain.launch.submit import run_here

        return run_here(spec, quiet)
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
        check_choice("--status", status, STATUSES)
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
        cells = (record.name, record.status, record.secondary_status, created, elapsed, layout)
        rows.append((*cells, str(last) if last else "-"))
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


def _metrics(name: str, plot: str | None, form: str | None) -> int:
    from dtrain.jobs.metrics import METRIC_FORMATS, format_metrics, plot_metrics
    from dtrain.jobs.store import JobStore

    if form is not None:
        check_choice("--format", form, METRIC_FORMATS)
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except BrokenPipeError:  # `dtrain describe X | head`: the reader left, nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _main(argv: list[str]) -> int:
    if argv[:1] == ["agent"]:
        from dtrain.launch.agent import main as agent

        agent(argv[1:], prog="dtrain agent")
    args = _parse(argv)
    try:
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
        if args.command == "stop":
            return _stop(args.name)
        if args.command == "metrics":
            return _metrics(args.name, args.plot, args.format)
        if args.command == "plan":
            return plan_command.run(args)
        if args.command == "ui":
            from dtrain.ui.serve import serve

            return serve(args.host, args.port, args.token_file, sys.stdout)
    except DtrainError as error:
        print(f"dtrain: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())

"""A job across two machines: dtrain's launcher against torchrun, on the same two machines.

The machines are two network namespaces joined by a veth pair capped with ``tc tbf`` at 1 Gbit/s
each way (``_netns.py``; needs root and iproute2). Both launchers run the same script
(``_cluster_worker.py``) on 2 hosts x 2 processes, and take turns, run by run, so that the drift
of this shared machine falls on both.

* ``startup``: seconds from launching the job on both machines (dtrain: the controller with
  ``--cluster join://`` and one ``dtrain agent`` per machine; torchrun: ``--rdzv-backend c10d``,
  ``is_host`` on the first machine) to the end of the first training step of a tiny model.
  Target: dtrain / torchrun <= 1.2.
* ``throughput``: samples/s of data-parallel training of 2 x Linear(4096, 4096) (134 MB of fp32
  gradients), global batch 64, SGD: a dtrain job with dtrain's DistributedDataParallel
  (hierarchical, bf16 gradients) against torchrun with torch's DDP. Target: >= 1.7x.

    python benchmarks/cluster.py --scenario all --json out/cluster.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _netns  # benchmarks/ is the script's directory

WORKER = Path(__file__).resolve().parent / "_cluster_worker.py"
PROCESSES = 2
PORT = 29400
RUN_NUMBERS = itertools.count()


def dtrain_commands(
    hosts: tuple[_netns.Host, _netns.Host], scratch: Path, arguments: dict[str, Any], run: int
) -> list[list[str]]:
    """The controller and an agent on each machine, as a user would start them."""
    a = hosts[0]
    join = f"{a.address}:{PORT + run}"
    secret = scratch / "secret"
    if not secret.exists():
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
    dtrain = [sys.executable, "-m", "dtrain.cli"]
    controller = [
        *dtrain, "run", WORKER.name, "--source-dir", str(scratch / "job"),
        "--job-name", f"bench-{os.getpid()}-{run}", "--instance-count", "2",
        "--processes-per-host", str(PROCESSES), "--instance-type", "local_cpu",
        "--cluster", f"join://{join}", "--secret-file", str(secret), "--quiet",
        "--hyperparameters", json.dumps(arguments),
    ]  # fmt: skip
    agents = [
        host.command(
            [
                *dtrain,
                "agent",
                "--join",
                join,
                "--secret-file",
                str(secret),
                "--host",
                f"algo-{index + 1}",
            ]
        )
        for index, host in enumerate(hosts)
    ]
    return [a.command(controller), *agents]


def torchrun_commands(
    hosts: tuple[_netns.Host, _netns.Host], arguments: dict[str, Any], run: int
) -> list[list[str]]:
    """torchrun on each machine, c10d rendezvous hosted by the first (``is_host``)."""
    flags = [f"--{key}={value}" for key, value in arguments.items()]
    return [
        host.command(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(PROCESSES),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{hosts[0].address}:{PORT + run}",
                "--rdzv-id",
                f"bench{run}",
                "--rdzv-conf",
                f"is_host={int(index == 0)}",
                "--local-addr",
                host.address,
                str(WORKER),
                *flags,
            ]
        )
        for index, host in enumerate(hosts)
    ]


def launch(
    launcher: str,
    hosts: tuple[_netns.Host, _netns.Host],
    scratch: Path,
    arguments: dict[str, Any],
    run: int,
) -> dict[str, Any]:
    """One job; its rank 0's report, with ``startup_s`` from the launch to its first step."""
    out = scratch / f"{launcher}-{run}.json"
    arguments = {**arguments, "out": str(out)}
    if launcher == "dtrain":
        commands = dtrain_commands(hosts, scratch, arguments, run)
        envs = [{**os.environ, "DTRAIN_HOME": str(scratch / "home")}] * 3
    else:
        commands = torchrun_commands(hosts, arguments, run)
        envs = [{**os.environ, "GLOO_SOCKET_IFNAME": host.interface} for host in hosts]
    log_dir = scratch / f"{launcher}-{run}-logs"
    log_dir.mkdir()
    started = time.time()
    _netns.run_workers(commands, envs, timeout=600, log_dir=log_dir)
    report = json.loads(out.read_text())
    report["startup_s"] = report["first_step_end"] - started
    return report


def alternate(
    hosts: tuple[_netns.Host, _netns.Host],
    scratch: Path,
    arguments: dict[str, dict[str, Any]],
    runs: int,
) -> dict[str, list[dict[str, Any]]]:
    """``runs`` jobs of each launcher (with its ``arguments``), in turns; which goes first
    alternates."""
    reports: dict[str, list[dict[str, Any]]] = {"dtrain": [], "torchrun": []}
    for run in range(runs):
        order = ("dtrain", "torchrun") if run % 2 == 0 else ("torchrun", "dtrain")
        for launcher in order:
            number = next(RUN_NUMBERS)
            reports[launcher].append(launch(launcher, hosts, scratch, arguments[launcher], number))
    return reports


def startup(hosts: tuple[_netns.Host, _netns.Host], scratch: Path, runs: int) -> dict[str, Any]:
    tiny = {"ddp": "torch", "width": 64, "steps": 1}
    reports = alternate(hosts, scratch, {"dtrain": tiny, "torchrun": tiny}, runs)
    seconds = {name: [r["startup_s"] for r in found] for name, found in reports.items()}
    ratios = [d / t for d, t in zip(seconds["dtrain"], seconds["torchrun"], strict=True)]
    return {
        "seconds": seconds,
        "dtrain_median_s": statistics.median(seconds["dtrain"]),
        "torchrun_median_s": statistics.median(seconds["torchrun"]),
        "ratio_per_pair": ratios,
        "ratio_median": statistics.median(ratios),
        "target": "dtrain / torchrun <= 1.2",
    }


def throughput(
    hosts: tuple[_netns.Host, _netns.Host], scratch: Path, runs: int, steps: int, warmup: int
) -> dict[str, Any]:
    common = {"steps": steps + warmup, "warmup": warmup, "batch": 64}
    arguments = {"dtrain": {**common, "ddp": "dtrain"}, "torchrun": {**common, "ddp": "torch"}}
    reports = alternate(hosts, scratch, arguments, runs)
    rates = {
        name: [64 / statistics.median(report["step_s"]) for report in found]
        for name, found in reports.items()
    }
    speedups = [d / t for d, t in zip(rates["dtrain"], rates["torchrun"], strict=True)]
    return {
        "samples_per_s": {
            "dtrain job, dtrain DDP (hierarchical, bf16)": rates["dtrain"],
            "torchrun, torch DDP": rates["torchrun"],
        },
        "speedup_per_pair": speedups,
        "speedup_median": statistics.median(speedups),
        "target": "dtrain / torchrun >= 1.7",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("startup", "throughput", "all"), default="all")
    parser.add_argument("--runs", type=int, default=5, help="jobs per launcher (startup)")
    parser.add_argument("--throughput-runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per throughput job")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    reason = _netns.unavailable_reason()
    if reason:
        sys.exit(f"cluster benchmark needs network namespaces: {reason}")
    scratch = Path(tempfile.mkdtemp(prefix="dtrain-cluster-bench-"))
    (scratch / "job").mkdir()  # the dtrain job's source dir: the worker alone
    shutil.copy(WORKER, scratch / "job" / WORKER.name)
    results: dict[str, Any] = {}
    try:
        with _netns.veth_pair(prefix="dtc", rate="1gbit") as hosts:
            if args.scenario in ("startup", "all"):
                results["startup"] = startup(hosts, scratch, args.runs)
                print(json.dumps(results["startup"], indent=2), flush=True)
            if args.scenario in ("throughput", "all"):
                results["throughput"] = throughput(
                    hosts, scratch, args.throughput_runs, args.steps, args.warmup
                )
                print(json.dumps(results["throughput"], indent=2), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

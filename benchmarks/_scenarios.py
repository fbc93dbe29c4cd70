"""How a benchmark with several scenarios reports: each chosen scenario run in turn, its table
printed as soon as it is done, and every figure written to JSON at the end."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch


def run_scenarios(
    args: argparse.Namespace,
    runners: Mapping[str, Callable[[argparse.Namespace], dict[str, Any]]],
    tables: Mapping[str, Callable[[dict[str, Any]], str]],
) -> None:
    """Run ``args.scenario`` (every one of ``runners`` for ``all``), print each one's table, and
    write the report to ``args.json`` if given."""
    chosen = tuple(runners) if args.scenario == "all" else (args.scenario,)
    report: dict[str, Any] = {"torch": torch.__version__, "cpus": os.cpu_count()}
    for name in chosen:
        report[name] = runners[name](args)
        print(tables[name](report[name]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))

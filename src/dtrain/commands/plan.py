"""``dtrain plan``: profile a model from a Python file and print its partition plan, as a job
would plan it at its first step (the same profile, ``smp.partition`` placements as constraints),
with each partition's peak memory and, given ``--memory-per-rank``, a layout that fits.

The parser is built for every ``dtrain`` command, so this module imports only what the command
line needs; torch and the planner load when the command runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from dtrain.errors import ConfigError, check_choice, did_you_mean
from dtrain.exits import EXIT_FAILED, EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``dtrain plan``'s arguments."""
    parser.add_argument(
        "model", metavar="FILE:FACTORY", help="Python file and its function returning the nn.Module"
    )
    parser.add_argument(
        "--input",
        default="sample_batch",
        metavar="[FILE:]FUNCTION",
        help="function returning example inputs: (args, kwargs), a tuple of args, or one "
        "argument (default: sample_batch in the model's file)",
    )
    parser.add_argument("--partitions", type=int, required=True, help="pipeline partitions")
    parser.add_argument(
        "--memory-weight", type=float, default=0.2, help="0..1, memory against compute balance"
    )
    parser.add_argument(
        "--repeats", type=int, help="timed passes (times are medians; default: as many as a job)"
    )
    parser.add_argument(
        "--without-memory",
        action="store_true",
        help="create the model without memory (as smp.delay_param_initialization does) and plan "
        "from its shapes and operation counts, untimed: for models larger than this machine",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="microbatches per step; the --input batch is one of them (default 1)",
    )
    parser.add_argument(
        "--pipeline", default="interleaved", help="the pipeline's schedule: interleaved, simple"
    )
    parser.add_argument(
        "--active-microbatches",
        type=int,
        help="most microbatches in flight (default: partitions + 2, at most --microbatches)",
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        help="whose state the memory per partition counts: adam (default), adamw, "
        "sgd-momentum, sgd",
    )
    precision = parser.add_mutually_exclusive_group()
    for name in ("fp16", "bf16"):
        precision.add_argument(
            f"--{name}",
            action="store_const",
            const=name,
            dest="half_precision",
            help=f"{name} parameters with fp32 masters (SMP's {name} parameter)",
        )
    parser.add_argument(
        "--memory-per-rank",
        metavar="SIZE",
        help="fail (exit 1) naming a layout that fits when a partition needs more, e.g. 8GiB",
    )
    parser.add_argument(
        "--max-partitions",
        type=int,
        help="most partitions the layout proposed by --memory-per-rank may have (default 8)",
    )
    parser.add_argument(
        "--depth",
        type=int,
        metavar="N",
        help="show N levels of the module tree, folding deeper modules into their row "
        "(default: fold below each unit the planner placed)",
    )
    parser.add_argument("--json", metavar="OUT.json", help="write the plan as JSON")
    parser.add_argument(
        "--png",
        metavar="OUT.png",
        help="draw each partition's predicted time, operations and peak memory (matplotlib)",
    )
    parser.add_argument(
        "--dot",
        metavar="OUT.dot",
        help="write the plan as Graphviz text (rendering it needs Graphviz, which dtrain does "
        "not install; --png draws without it)",
    )


def _import_file(flag: str, spec: str, path: Path) -> ModuleType:
    from dtrain.compat import add_shim_to_path

    if path.suffix != ".py" or not path.is_file():
        raise ConfigError(flag, spec, f"FILE:FUNCTION naming an existing Python file ({path})")
    module_spec = importlib.util.spec_from_file_location(f"_dtrain_plan_{path.stem}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses look their module up while it runs
    folder = str(path.parent.resolve())
    sys.path.insert(0, folder)  # so the file can import its neighbours
    add_shim_to_path()  # `import smdistributed...` works as it does in a job; stays
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


def _memory_settings(args: argparse.Namespace) -> Any:
    """The ``dtrain plan`` flags that decide memory per partition, checked for their form."""
    from dtrain.modelparallel.plan.memory import OPTIMIZER_STATES, MemorySettings
    from dtrain.modelparallel.scheduling.policy import PIPELINES

    check_choice("--pipeline", args.pipeline, PIPELINES)
    check_choice("--optimizer", args.optimizer, OPTIMIZER_STATES)
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


def run(args: argparse.Namespace) -> int:
    """Run ``dtrain plan``: its exit status."""
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

"""SMP v2's memory per rank: the script's own FSDP under ``tsm.init()`` against one process,
and what activation offloading keeps.

Both scenarios train a Hugging Face Llama (layers of width 1024, feed-forward 4096, 16 heads,
vocabulary 8192, SDPA attention; random weights, nothing downloaded) in float32. The ranks build
it as AWS's ``train_lib.py`` does: created on the meta device, ``tsm.transform``, a
``DelayedParamIniter`` whose ``param_init_fn`` and ``post_param_init_fn`` make each FSDP unit
as it is sharded (no rank ever holds the whole model), FSDP1 over each decoder layer
(``transformer_auto_wrap_policy`` over SMP's ``TransformerLayer``, ``use_orig_params``, the
strategy ``HYBRID_SHARD``, which the degrees' groups decide), each rank training on its
data-parallel share of the global batch. Every process has the heap setting ``tsm.init`` makes
(large freed blocks returned to the system, :mod:`dtrain.modelparallel.heap`); the one process
gets it from the benchmark.

Scenarios (each prints a table; ``--json`` writes every figure):

* ``sharding``: ``--layers`` layers (20: 353M parameters; its parameters, gradients and AdamW's
  two moments 5.3 GiB), AdamW, 2 steps on a global batch of ``--batch`` sequences of 128
  tokens. Layouts: hybrid shard 2 (2 ranks), tp 2 x hybrid shard 2 (4 ranks). Peak RSS of
  each rank (``ru_maxrss``: everything the process held, torch itself included) over the peak
  of one process training the same model, created eagerly, on the whole batch; each layout and
  the one process in a fresh world. With ``--breakdown``, also what each process holds after
  its last step (its parameters, gradients and optimizer state, the rest).
* ``offloading``: ``--offload-layers`` layers, hybrid shard 2 on 2 ranks, each variant in a
  fresh world: plain; AWS's activation checkpointing (each decoder layer in torch's reentrant
  ``checkpoint_wrapper``); and that with ``sm_activation_offloading``
  (``activation_loading_horizon`` ``--horizon``), where the script wraps the model in torch's
  ``offload_wrapper``, as AWS's script does when ``tsm.state.sm_activation_offloading`` is
  set. Each rank runs a forward and backward on a sequence of 128 tokens (FSDP's first-use
  allocations, the gradients), then one on a sequence of ``--long-seq`` tokens, measured: the
  bytes its autograd graph holds for backward when the forward ends (the saved tensors'
  storages, found as torch's own offloading test finds them, other than the parameters'), and
  the peak resident memory over the forward and backward above the resident memory before
  them (``VmHWM``, reset). On CPU nothing leaves a device: ``offload_wrapper`` copies every
  tensor the forward saves into new host memory, so the bytes it holds are the ones a GPU
  would no longer hold between forward and backward, while the resident figure cannot fall.
  Also the warnings ``tsm.init`` gave that name the horizon.

    python benchmarks/smp_v2_memory.py --scenario all --json out/smp_v2_memory.json
"""

from __future__ import annotations

import torch.sagemaker as tsm  # before torch.distributed.fsdp's names, as AWS's scripts do

# isort: split
import argparse
import functools
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _memory import (
    held,
    held_text,
    layout_lines,
    lifetime_peak_mib,
    peak_mib,
    reset_peak,
    resident_mib,
)
from _scenarios import run_scenarios
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.sagemaker.delayed_param import DelayedParamIniter
from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

from dtrain.modelparallel import heap
from modelparallel import init_world, leave_world, spawn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB = 8192
SEQ = 128
LAYOUTS = {
    "hybrid shard 2": (2, {"hybrid_shard_degree": 2}),
    "tp 2 x hybrid shard 2": (4, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}),
}
OFFLOADING_VARIANTS = ("plain", "checkpointed", "checkpointed + offloaded")


def llama(layers: int, seq: int) -> nn.Module:
    """The benchmark's Llama, created where the default device is, in training mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=seq,
        attention_dropout=0.0, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").train()


def batches(count: int, batch: int, seq: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (batch, seq), generator=generator) for _ in range(count)]


def sharded(layers: int, seq: int) -> nn.Module:
    """The model as AWS's scripts build it under ``tsm.init`` (see the module's docstring)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = llama(layers, seq)
    model = tsm.transform(model)
    initer = DelayedParamIniter(model)
    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer}
    )
    with initer.validate_params_and_buffers_inited():
        return FSDP(
            model,
            auto_wrap_policy=policy,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_id=torch.device("cpu"),  # AWS's scripts: torch.cuda.current_device()
            use_orig_params=True,
            param_init_fn=initer.get_param_init_fn(),
            post_param_init_fn=initer.get_post_param_init_fn(),
        )


def my_rows(data: list[Tensor]) -> list[Tensor]:
    """This rank's data-parallel share of each global batch."""
    share = len(data[0]) // tsm.state.dp_size
    return [ids[tsm.state.dp_rank * share : (tsm.state.dp_rank + 1) * share] for ids in data]


def local(tensors: Any) -> list[Tensor]:
    """This rank's own part of each tensor (a DTensor's local tensor)."""
    return [getattr(t, "_local_tensor", t) for t in tensors if isinstance(t, Tensor)]


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The parameters, gradients and optimizer state this process holds."""
    params = local(model.parameters())
    moments = [v for s in optimizer.state.values() for v in s.values()]
    return [*params, *local(p.grad for p in params), *local(moments)]


def in_world(rank: int, port: int, args: argparse.Namespace, results: Any, work: Any) -> None:
    """Run ``work(rank)`` in a fresh world of ``args.world``; rank 0 puts every rank's row."""
    init_world(rank, args.world, port)
    row = work(rank)
    rows: list[Any] = [None] * args.world
    dist.all_gather_object(rows, row)
    leave_world(results, rows if rank == 0 else None)


# --- scenario: sharding ------------------------------------------------------------------------


def train_sharded(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Two AdamW steps of the layout ``args.layout`` (one process for ``None``)."""
    data = batches(args.steps, args.batch, SEQ)
    if args.layout is None:
        torch.manual_seed(0)
        model = llama(args.layers, SEQ)
    else:
        tsm.init(LAYOUTS[args.layout][1])
        model = sharded(args.layers, SEQ)
        data = my_rows(data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for ids in data:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    state = state_tensors(model, optimizer)
    return {
        "rank": rank,
        "peak_rss_mib": lifetime_peak_mib(),
        "parameter_mib": sum(t.nbytes for t in local(model.parameters())) / 2**20,
        "held_after_mib": held(state) if args.breakdown else {},
    }


def sharding_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    if args.layout is None:
        heap.prepare(keep_freed_blocks=False)  # as tsm.init sets the ranks': one process alike
    in_world(rank, port, args, results, functools.partial(train_sharded, args))


def run_sharding(args: argparse.Namespace) -> dict[str, Any]:
    one = spawn(sharding_worker, 1, argparse.Namespace(**vars(args), world=1, layout=None))[0]
    layouts = {}
    for label in args.layouts:
        world = LAYOUTS[label][0]
        chosen = argparse.Namespace(**vars(args), world=world, layout=label)
        ranks = spawn(sharding_worker, world, chosen)
        peaks = [r["peak_rss_mib"] for r in ranks]
        layouts[label] = {
            "peak_rss_mib": peaks,
            "largest_over_single": max(peaks) / one["peak_rss_mib"],
            "parameter_mib": [r["parameter_mib"] for r in ranks],
            "held_after_mib": [r["held_after_mib"] for r in ranks],
        }
    return {"layers": args.layers, "batch": args.batch, "one_process": one, "layouts": layouts}


def sharding_table(r: dict[str, Any]) -> str:
    one = r["one_process"]
    lines = [
        f"peak RSS per rank, MiB ({r['layers']} layers, global batch {r['batch']}; one process:"
        f" {one['peak_rss_mib']:.0f}, its parameters {one['parameter_mib']:.0f})"
    ]
    if one["held_after_mib"]:
        lines.append("  one process after its last step, MiB: " + held_text(one["held_after_mib"]))
    return "\n".join(lines + layout_lines(r["layouts"], 22))


# --- scenario: offloading ----------------------------------------------------------------------


def saved_for_backward(loss: Tensor, model: nn.Module) -> int:
    """Bytes of the storages the autograd graph of ``loss`` holds for backward, the parameters'
    own excepted: every node's ``_saved_*`` tensors, and a custom function's (the reentrant
    checkpoint's inputs), unpacked as backward would (``offload_wrapper``'s host copies)."""
    parameters = {p.untyped_storage().data_ptr() for p in local(model.parameters())}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    nodes: list[Any] = [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        saved = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            saved.extend(node.saved_tensors)
        for tensor in local(t for value in saved for t in _tensors(value)):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                storages[storage.data_ptr()] = storage.nbytes()
        nodes.extend(following for following, _ in node.next_functions)
    return sum(storages.values())


def _tensors(value: Any) -> list[Any]:
    return list(value) if isinstance(value, tuple | list) else [value]


def train_offloading(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """A forward and backward of ``args.variant`` on a long sequence, measured (see the
    module's docstring)."""
    offloaded = args.variant == "checkpointed + offloaded"
    parameters = {"hybrid_shard_degree": 2, "sm_activation_offloading": offloaded}
    if offloaded:
        parameters["activation_loading_horizon"] = args.horizon
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tsm.init(parameters)
    model = sharded(args.offload_layers, args.long_seq)
    if args.variant != "plain":
        wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, TransformerLayer)
        )
    if tsm.state.sm_activation_offloading:
        model = offload_wrapper(model)
    warm_up, long = (my_rows(batches(1, 2, seq))[0] for seq in (SEQ, args.long_seq))
    model(input_ids=warm_up, labels=warm_up).loss.backward()  # FSDP's first-use allocations
    figures = {"before_mib": resident_mib()}
    reset_peak()
    loss = model(input_ids=long, labels=long).loss
    figures["saved_mib"] = saved_for_backward(loss, model) / 2**20
    loss.backward()
    figures["growth_mib"] = peak_mib() - figures["before_mib"]
    horizon = [str(w.message) for w in caught if "activation_loading_horizon" in str(w.message)]
    return {"rank": rank, **figures, "horizon_warnings": horizon}


def offloading_worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    in_world(rank, port, args, results, functools.partial(train_offloading, args))


def run_offloading(args: argparse.Namespace) -> dict[str, Any]:
    variants = {
        variant: spawn(
            offloading_worker, 2, argparse.Namespace(**vars(args), world=2, variant=variant)
        )
        for variant in OFFLOADING_VARIANTS
    }
    return {
        "layers": args.offload_layers,
        "seq": args.long_seq,
        "horizon": args.horizon,
        "variants": variants,
    }


def offloading_table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['layers']} layers, hybrid shard 2, one sequence of {r['seq']} tokens per rank; per "
        "rank, MiB: held for backward when the forward ends; peak resident growth over the forward "
        "and backward"
    ]
    for variant, ranks in r["variants"].items():
        for row in ranks:
            lines.append(
                f"  {variant:25} rank {row['rank']}  {row['saved_mib']:8.1f} "
                f"{row['growth_mib']:8.1f}"
            )
    warned = {
        w for ranks in r["variants"].values() for row in ranks for w in row["horizon_warnings"]
    }
    lines.append(
        f"activation_loading_horizon {r['horizon']}: "
        + ("; ".join(sorted(warned)) if warned else "no warning")
    )
    return "\n".join(lines)


TABLES = {"sharding": sharding_table, "offloading": offloading_table}
RUNNERS = {"sharding": run_sharding, "offloading": run_offloading}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=(*TABLES, "all"), default="all")
    parser.add_argument("--layers", type=int, default=20, help="sharding: decoder layers")
    parser.add_argument("--batch", type=int, default=8, help="sharding: global batch (sequences)")
    parser.add_argument("--steps", type=int, default=2, help="sharding: steps")
    parser.add_argument(
        "--layouts",
        type=lambda text: text.split(","),
        default=list(LAYOUTS),
        help="sharding: comma-separated labels of the layouts to run besides one process",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="sharding: what each rank holds after its steps"
    )
    parser.add_argument("--offload-layers", type=int, default=4, help="offloading: layers")
    parser.add_argument("--long-seq", type=int, default=4096, help="offloading: tokens")
    parser.add_argument(
        "--horizon", type=int, default=4, help="offloading: activation_loading_horizon"
    )
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    run_scenarios(args, RUNNERS, TABLES)


if __name__ == "__main__":
    main()

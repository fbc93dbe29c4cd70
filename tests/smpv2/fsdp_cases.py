"""The script's own FSDP under ``tsm.init()``, as AWS's SMP v2 scripts build it, against one
process: tiny Hugging Face Llama and GPT-NeoX models (random weights, nothing downloaded) and the
recipes each test file trains in one world.

On every rank :func:`train_cases` joins one world (gloo, or dtrain's ``smddp``, AWS's scripts'
backend) and, per :class:`Case`, runs
``tsm.init(case.parameters)``, builds the model as AWS's ``train_lib.py`` does (FSDP1 with
``transformer_auto_wrap_policy`` over the decoder layers, ``use_orig_params``, a ``device_id``;
or FSDP2's ``fully_shard`` per layer and on the root), trains ``STEPS`` SGD steps on its
data-parallel share of each global batch, and returns the mean loss over the world and the full
parameters; then ``tsm.shutdown()``. :func:`reference` trains the same model in one process on
the whole batches.

``torch.sagemaker`` is imported before torch's FSDP names, as AWS's scripts do, so those names
are SMP v2's (:mod:`dtrain.compat.torch_fsdp`).
"""

from __future__ import annotations

import torch.sagemaker as tsm  # before torch.distributed.fsdp's names, as AWS's scripts do

# isort: split
import copy
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.distributed.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_sharded_data_parallel as torch_fsdp1
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor

from dtrain.dataparallel import process_group
from dtrain.smpv2 import shutdown

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 64
LR = 0.1
STEPS = 3
HF_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}

Batch = dict[str, Tensor]


def _llama(tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
        attention_dropout=0.0, use_cache=False, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM._from_config(config, attn_implementation="eager")


def _neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    return GPTNeoXForCausalLM._from_config(config, attn_implementation="eager")


def decoder_layer(family: str) -> type[nn.Module]:
    """The decoder layer AWS's ``fsdp_utils.get_transformer_layer`` names for the family."""
    if family == "neox":
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer

        return GPTNeoXLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama,
    "llama_tied": functools.partial(_llama, tied=True),
    "neox": _neox,
}


def build(family: str) -> nn.Module:
    """The family's model with its weights drawn under seed 0, in training mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return FAMILIES[family]().train()


def batch(step: int) -> Batch:
    ids = torch.randint(
        0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step)
    )
    return {"input_ids": ids, "labels": ids}


@dataclass
class Trained:
    losses: list[float]
    params: dict[str, Tensor]
    extra: dict[str, Any] = field(default_factory=dict)


def _bf16_copy(model: nn.Module) -> nn.Module:
    """A copy whose parameters are bfloat16 and buffers float32, as FSDP's ``MixedPrecision(
    param_dtype=bfloat16, buffer_dtype=float32)`` computes."""
    compute = copy.deepcopy(model)
    for param in compute.parameters():
        param.data = param.data.to(torch.bfloat16)
    return compute


def reference(family: str, bf16: bool = False) -> Trained:
    """One process, the whole batch each step, SGD. With ``bf16``, the one-process bfloat16
    recipe FSDP's mixed precision follows: float32 master weights; forward and backward on a
    bfloat16 copy of the parameters (buffers float32); the gradients cast to float32 for the
    float32 step."""
    model = build(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        compute = _bf16_copy(model) if bf16 else model
        loss = compute(**batch(step)).loss
        loss.backward()
        if bf16:
            for master, copied in zip(model.parameters(), compute.parameters(), strict=True):
                master.grad = copied.grad.float()
        optimizer.step()
        losses.append(loss.item())
    return Trained(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


@dataclass(frozen=True)
class Case:
    family: str
    parameters: dict[str, Any]
    """The SMP v2 parameters given to ``tsm.init``."""
    fsdp: str = "fsdp1"
    """``fsdp1`` (``FullyShardedDataParallel`` as AWS's scripts call it), ``fsdp2``
    (``fully_shard``), or ``torch`` (torch's own FSDP1 class, bypassing dtrain's)."""
    strategy: ShardingStrategy | None = ShardingStrategy.HYBRID_SHARD
    bf16: bool = False
    delayed: bool = False
    """Created on the meta device, its parameters by ``param_init_fn`` in FSDP, and re-tied by
    ``post_param_init_fn`` (as with SMP's ``DelayedParamIniter``)."""
    post_init: bool = True
    offloading: bool = False
    """AWS's recipe: reentrant activation checkpointing of the decoder layers, then torch's
    ``offload_wrapper`` on the whole model."""
    tensor_parallel: bool = False
    """Split over ``tsm.state``'s tp group by ``tsm.transform`` (DTensors on the tp mesh), before
    FSDP, as AWS's scripts do."""


def train_cases(cases: list[Case], backend: str = "gloo") -> list[Trained | str | None]:
    """On every rank: each case in turn in a world of ``backend`` (see the module's docstring).
    Rank 0 returns a ``Trained`` per case (or the error a case raised, as text); other ranks
    None."""
    process_group.init_process_group(backend)
    results: list[Trained | str | None] = []
    for case in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tsm.init(case.parameters)
            try:
                trained: Trained | str = _train(case)
            except ValueError as error:
                trained = str(error)
            finally:
                shutdown()
        if isinstance(trained, Trained):
            trained.extra["warnings"] = [str(w.message) for w in caught]
        results.append(trained if dist.get_rank() == 0 else None)
    dist.destroy_process_group()
    return results


def _train(case: Case) -> Trained:
    model, extra = _wrapped(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    share = GLOBAL_BATCH // tsm.state.dp_size
    mine = slice(tsm.state.dp_rank * share, (tsm.state.dp_rank + 1) * share)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(**{k: v[mine] for k, v in batch(step).items()}).loss
        loss.backward()
        optimizer.step()
        mean = loss.detach().float()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return Trained(losses, full_parameters(model, case.fsdp), extra)


def shard(model: nn.Module, family: str, fsdp: str, **options: Any) -> nn.Module:
    """``model`` sharded as AWS's scripts shard it: FSDP2's ``fully_shard`` on each decoder
    layer and the root (``fsdp2``), else FSDP1 with the decoder layers as units, ``options`` its
    other arguments (``wrapper``: another FSDP1 class)."""
    layer = decoder_layer(family)
    if fsdp == "fsdp2":
        for module in model.modules():
            if isinstance(module, layer):
                fully_shard(module)
        fully_shard(model)
        return model
    wrapper = options.pop("wrapper", FSDP)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer})
    return wrapper(
        model,
        auto_wrap_policy=policy,
        device_id=torch.device("cpu"),  # AWS's scripts: torch.cuda.current_device()
        **options,
    )


def _wrapped(case: Case) -> tuple[nn.Module, dict[str, Any]]:
    """The case's model wrapped as its FSDP says, and what the wrapping recorded."""
    extra: dict[str, Any] = {}
    layer = decoder_layer(case.family)
    model = build(case.family)
    if case.tensor_parallel:
        model = tsm.transform(model)
    if case.fsdp == "fsdp2":
        model = shard(model, case.family, "fsdp2")
        extra["meshes"] = {str(p.device_mesh.mesh.tolist()) for p in model.parameters()}
        shard_group = tsm.state.mesh("replicate", "hybrid_shard").get_group(1)
        extra["backend"] = dist.get_backend(shard_group)
        return model, extra
    options: dict[str, Any] = {}
    if case.delayed:
        model, options, extra["post_init_calls"] = _delayed(case.family, case.post_init)
    if case.bf16:
        options["mixed_precision"] = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.float32
        )
    if case.fsdp == "torch":
        options["wrapper"] = torch_fsdp1.FullyShardedDataParallel
    model = shard(
        model, case.family, "fsdp1", sharding_strategy=case.strategy, use_orig_params=True,
        **options,
    )  # fmt: skip
    extra["process_group"] = dist.get_process_group_ranks(model.process_group)
    extra["backend"] = dist.get_backend(model.process_group)
    extra["compute_dtypes"] = _compute_dtypes(model)
    if case.offloading:
        wrap = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, layer)
        )
        model = offload_wrapper(model)
        # AWS's script reads the FSDP's process group through the wrapper.
        extra["process_group"] = dist.get_process_group_ranks(model.process_group)
    return model, extra


def _compute_dtypes(model: nn.Module) -> set[torch.dtype]:
    """Filled during each forward with the dtypes of the weights the linear layers compute with."""
    seen: set[torch.dtype] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(lambda m, _: seen.add(m.weight.dtype))
    return seen


def _delayed(family: str, post_init: bool) -> tuple[nn.Module, dict[str, Any], list[str]]:
    """The family's model made on the meta device, with a ``param_init_fn`` that creates each
    module's own parameters and buffers (``to_empty``, module by module, which unties tied
    weights) with the values :func:`build` draws, and SMP's ``post_param_init_fn``, which ties
    them again (as ``DelayedParamIniter``'s does); and the list of the classes
    ``post_param_init_fn`` is called on, in order."""
    with torch.device("meta"):
        model = FAMILIES[family]().train()
    eager = dict(build(family).named_modules())
    names = {id(module): name for name, module in model.named_modules()}
    calls: list[str] = []

    def param_init_fn(module: nn.Module) -> None:
        source = eager[names[id(module)]]
        module.to_empty(device="cpu", recurse=False)
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        with torch.no_grad():
            for name, tensor in own:
                tensor.copy_(getattr(source, name))

    def post_param_init_fn(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        if hasattr(module, "tie_weights"):
            module.tie_weights()

    options: dict[str, Any] = {"param_init_fn": param_init_fn}
    if post_init:
        options["post_param_init_fn"] = post_param_init_fn
    return model, options, calls


def full_parameters(model: nn.Module, fsdp: str) -> dict[str, Tensor]:
    """Every rank's view of the whole model's state, with the plain model's names."""
    if fsdp == "fsdp2":
        state = model.state_dict()
    else:
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    return {
        k.replace("_checkpoint_wrapped_module.", ""): v.detach().clone() for k, v in state.items()
    }

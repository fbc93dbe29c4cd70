"""Hugging Face ``transformers`` models for the equivalence tests: tiny configs, random weights.

Nothing is downloaded: every model is built with ``from_config`` from an explicit small config
(4 layers, hidden 32, 2 heads, vocabulary 64, sequences of 16; T5: 3 + 3 blocks of width 128, 4
heads), dropout off and eager attention, under a fixed seed. Batches are keyword dictionaries
(``input_ids``, ``attention_mask``, ``labels``) and the loss is the model's own ``.loss``.

The losses are means over the labelled tokens of whatever batch the model sees, so a microbatch
(or a data-parallel shard) is only comparable with the whole batch if every microbatch holds as
many labelled tokens as any other: the padding and masking patterns below keep the count equal
for every pair of consecutive rows (the smallest microbatch used is two rows).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel import state
from tests.modelparallel.equivalence import init_smp
from tests.modelparallel.models import seeded

GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 64
LR = 0.1
HF_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
"""Environment for the spawned ranks: offline, quiet."""

Batch = dict[str, Tensor]


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=4,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel._from_config(config, attn_implementation="eager")


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM._from_config(config, attn_implementation="eager")


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attention_dropout=0.0,
        use_cache=False,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation="eager")


def _t5() -> nn.Module:
    """T5 with its word embedding shared by encoder, decoder and the tied LM head (which scales
    the decoder's output by ``d_model**-0.5``), and a relative position bias that each stack's
    first block computes and passes on to the others."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=128,
        d_kv=32,
        d_ff=256,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration._from_config(config, attn_implementation="eager")


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(2000 + step)


PAD = (0, 3, 1, 2, 3, 0, 2, 1)
"""Right padding per row: every pair of consecutive rows pads 3 tokens."""


def _gpt2_batch(step: int) -> Batch:
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=_generator(step))
    mask = torch.ones(GLOBAL_BATCH, SEQ, dtype=torch.long)
    for row, pad in enumerate(PAD):
        if pad:
            mask[row, -pad:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


MASK_TOKEN = VOCAB - 1
MASKED_PER_ROW = 3


def _bert_batch(step: int) -> Batch:
    g = _generator(step)
    ids = torch.randint(0, VOCAB - 1, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.full_like(ids, -100)
    inputs = ids.clone()
    for row in range(GLOBAL_BATCH):
        where = torch.randperm(SEQ, generator=g)[:MASKED_PER_ROW]
        labels[row, where] = ids[row, where]
        inputs[row, where] = MASK_TOKEN
    return {
        "input_ids": inputs,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
    }


def _llama_batch(step: int) -> Batch:
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=_generator(step))
    return {"input_ids": ids, "labels": ids}


TARGET = 6
"""Labelled tokens of every row of :func:`_t5_batch` (the decoder's length)."""


def _t5_batch(step: int) -> Batch:
    """The padded rows of :func:`_gpt2_batch` for an encoder, ``TARGET`` labelled tokens a row
    for the decoder."""
    batch = _gpt2_batch(step)
    labels = torch.randint(1, VOCAB, (GLOBAL_BATCH, TARGET), generator=_generator(100 + step))
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels,
    }


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    split: tuple[str, ...]
    """Modules placed on partition 1 by hand (the rest stays on partition 0)."""
    batch: Callable[[int], Batch]
    attention: str
    """The attention submodule's name within a layer."""


CASES: dict[str, Case] = {
    "gpt2": Case(
        _gpt2, ("transformer.h.2", "transformer.h.3", "transformer.ln_f"), _gpt2_batch, "attn"
    ),
    # The MLM head's decoder is tied to the word embeddings: it stays on partition 0 with them.
    "bert": Case(_bert, ("bert.encoder.layer.2", "bert.encoder.layer.3"), _bert_batch, "attention"),
    "llama": Case(
        _llama, ("model.layers.2", "model.layers.3", "model.norm"), _llama_batch, "self_attn"
    ),
    # Split inside the decoder: the self-attention's position bias and the cross-attention's
    # zero bias (from block 0), the causal and padding masks and the encoder's states cross the
    # boundary; the shared embedding and the tied head stay on partition 0.
    "t5": Case(
        _t5,
        ("decoder.block.1", "decoder.block.2", "decoder.final_layer_norm"),
        _t5_batch,
        "layer.0",
    ),
}


IMAGE = (3, 8, 8)
CLASSES = 5


def _vit_batch(step: int) -> Batch:
    g = _generator(200 + step)
    pixels = torch.randn(GLOBAL_BATCH, *IMAGE, generator=g)
    return {
        "pixel_values": pixels,
        "labels": torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g),
    }


BATCHES: dict[str, Callable[[int], Batch]] = {
    **{name: case.batch for name, case in CASES.items()},
    "vit": _vit_batch,
}
"""Global batches by name: the cases', and those of models only the tensor-parallel tests train
(images)."""


@dataclass(frozen=True)
class Layout:
    case: str
    pipeline: str = "interleaved"
    microbatches: int = 2
    auto: bool = False
    checkpointing: bool | None = None
    """HF gradient checkpointing with ``use_reentrant`` this value; ``None``: off."""
    bf16: bool = False
    """``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward inside the step."""
    marked: bool = False
    """``smp.set_activation_checkpointing`` on every layer."""
    delayed: bool = False
    """Created inside ``smp.delay_param_initialization()``: each rank makes only its share."""
    float64: bool = False
    """Parameters in float64: rounding then stays near 1e-16, so whatever differs from one
    process by more is a real difference (a gradient lost, counted twice or split wrongly),
    not float32's summation order."""


@dataclass
class Trained:
    losses: list[float]
    params: dict[str, Tensor]
    partitions_used: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def build(case_name: str, layout: Layout | None = None) -> nn.Module:
    delayed = layout is not None and layout.delayed
    with smp.delay_param_initialization(enabled=delayed):
        module = seeded(0, CASES[case_name].build)
    if layout is not None and layout.float64:
        module.double()
    if layout is not None and layout.checkpointing is not None:
        kwargs = {"use_reentrant": layout.checkpointing}
        if hasattr(module, "activation_checkpointing_enable"):  # transformers 5 renamed it
            module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    module.train()
    return module


def _autocast(layout: Layout | None) -> AbstractContextManager[Any]:
    if layout is not None and layout.bf16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext()


def reference(
    case_name: str,
    steps: int,
    layout: Layout | None = None,
    microbatches: int = 1,
    model: nn.Module | None = None,
) -> Trained:
    """Single-process SGD on the whole global batch (same checkpointing / autocast settings)
    of the case's model, or of ``model`` on the case's batches.

    With ``microbatches`` > 1, each step runs the model on that many consecutive slices of the
    batch and averages their gradients, as a pipeline does (same shapes in every matmul).
    """
    model = build(case_name, layout) if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for index in range(steps):
        batch = CASES[case_name].batch(index)
        optimizer.zero_grad()
        step_loss = 0.0
        for part in range(microbatches):
            size = GLOBAL_BATCH // microbatches
            rows = slice(part * size, (part + 1) * size)
            with _autocast(layout):
                loss = model(**{k: v[rows] for k, v in batch.items()}).loss
            (loss / microbatches).backward()
            step_loss += loss.item() / microbatches
        optimizer.step()
        losses.append(step_loss)
    return Trained(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


def _init(layout: Layout, pipeline_degree: int) -> None:
    init_smp(pipeline_degree, layout.pipeline, layout.microbatches, layout.auto)


def _distributed(layout: Layout) -> tuple[nn.Module, smp.DistributedModel]:
    module = build(layout.case, layout)
    if not layout.auto:
        for name in CASES[layout.case].split:
            smp.set_partition(module.get_submodule(name), 1)
    if layout.marked:
        for layer in module.get_submodule(CASES[layout.case].split[0].rpartition(".")[0]):
            smp.set_activation_checkpointing(layer)
    return module, smp.DistributedModel(module)


def _count_forwards(module: nn.Module, layers: str, child: str) -> list[int]:
    """Counts, per layer of the ``layers`` list, the forwards of its submodule ``child`` on this
    rank. Transformers checkpoints a layer's ``forward``, not its ``__call__``, so the layer's
    own hooks miss the recomputation in the backward; its children's hooks see it."""
    calls = [0] * len(module.get_submodule(layers))

    def count(index: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            calls[index] += 1

        return hook

    for index, layer in enumerate(module.get_submodule(layers)):
        layer.get_submodule(child).register_forward_hook(count(index))
    return calls


def train_layouts(layouts: Sequence[Layout], steps: int, pipeline_degree: int = 2) -> list[Any]:
    """On every rank: train each layout in turn; rank 0 of each data-parallel replica returns
    ``Trained`` (losses of its shard, the gathered full parameters), other ranks None."""
    dist.init_process_group("gloo")
    results = []
    for layout in layouts:
        _init(layout, pipeline_degree)
        module, model = _distributed(layout)
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
        case = CASES[layout.case]
        calls = _count_forwards(module, case.split[0].rpartition(".")[0], case.attention)

        @smp.step
        def train_step(model: smp.DistributedModel, batch: Batch, layout: Layout = layout) -> Any:
            with _autocast(layout):
                loss = model(**batch).loss
            model.backward(loss)
            return loss

        losses = []
        for index in range(steps):
            batch = CASES[layout.case].batch(index)
            shard = GLOBAL_BATCH // smp.dp_size()
            rows = slice(smp.dp_rank() * shard, (smp.dp_rank() + 1) * shard)
            optimizer.zero_grad()
            output = train_step(model, {k: v[rows] for k, v in batch.items()})
            losses.append(float(output.reduce_mean()))
            optimizer.step()
        params = model.state_dict()
        plan = model.partition_plan()
        used = {plan.owner(name.rpartition(".")[0]) for name, _ in module.named_parameters()}
        # Only the owner's count: a caller replays the hooks of the submodules of a module it
        # called on another rank, which would count every remote forward twice.
        layers = case.split[0].rpartition(".")[0]
        owned = [
            n if plan.owner(f"{layers}.{i}") == smp.pp_rank() else 0 for i, n in enumerate(calls)
        ]
        everywhere: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, owned)
        extra = {"attention_calls": [sum(column) for column in zip(*everywhere, strict=True)]}
        results.append(Trained(losses, params, len(used), extra) if smp.pp_rank() == 0 else None)
        smp.shutdown()
    dist.destroy_process_group()
    return results


def reference_attentions(case_name: str) -> list[Tensor]:
    """Single-process forward with ``output_attentions=True``: every layer's attention map."""
    model = build(case_name)
    with torch.no_grad():
        out = model(**CASES[case_name].batch(0), output_attentions=True)
    return [a.detach().clone() for a in out.attentions]


def pipelined_attentions(layout: Layout) -> list[Tensor] | None:
    """Forward-only step with ``output_attentions=True``; on pp rank 0, the attention maps of
    the whole batch (microbatches concatenated), else None."""
    dist.init_process_group("gloo")
    _init(layout, 2)
    _, model = _distributed(layout)

    @smp.step
    def forward_step(model: smp.DistributedModel, batch: Batch) -> tuple[Tensor, ...]:
        out = model(**batch, output_attentions=True)
        return tuple(out.attentions)

    with torch.no_grad():
        outputs = forward_step(model, CASES[layout.case].batch(0))
    result = None
    if smp.pp_rank() == 0:
        result = [out.concat().detach().clone() for out in outputs]
    smp.shutdown()
    dist.destroy_process_group()
    return result


def train_wrapped(model: smp.DistributedModel, batches: str, steps: int) -> list[float]:
    """SGD steps of a wrapped HF model on this rank's share of ``BATCHES[batches]``' global
    batches, as SMP shards data: by ``dp_rank``, or with ``prescaled_batch`` by ``rdp_rank``
    (the tp group shares its rows); this rank's losses."""
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: smp.DistributedModel, batch: Batch) -> Any:
        loss = model(**batch).loss
        model.backward(loss)
        return loss

    prescaled = state.current().config["prescaled_batch"]
    rank, size = (smp.rdp_rank(), smp.rdp_size()) if prescaled else (smp.dp_rank(), smp.dp_size())
    rows = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        output = train_step(model, {k: v[rows] for k, v in BATCHES[batches](step).items()})
        losses.append(float(output.reduce_mean()))
        optimizer.step()
    return losses

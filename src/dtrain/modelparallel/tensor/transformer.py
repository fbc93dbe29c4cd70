"""``smp.nn.DistributedTransformerLayer``, ``DistributedTransformer`` and
``DistributedTransformerLMHead``: SMP's transformer stacks, built of the split blocks."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor.attention import MASKED, DistributedAttentionLayer
from dtrain.modelparallel.tensor.batch import scaled_batch
from dtrain.modelparallel.tensor.module import (
    TUNING_ARGUMENTS,
    UNSUPPORTED_EXTRAS,
    DistributedModule,
    refuse_unsupported,
    seeded,
)
from dtrain.modelparallel.tensor.output import DistributedTransformerOutputLayer

Pair = tuple[torch.Tensor, torch.Tensor | None]

NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
"""Parameters a keyword can name."""


def _check_layernorms(
    what: str, pre_layernorm: bool, post_layernorm: bool, single_pre_layernorm: bool
) -> None:
    if not (pre_layernorm or post_layernorm or single_pre_layernorm):
        raise ValueError(
            f"{what}: at least one of pre_layernorm, single_pre_layernorm and post_layernorm "
            "must be true"
        )


def _known(what: str, given: Mapping[str, Any], *takers: Callable[..., Any]) -> None:
    """Keywords a stack passes down to ``takers`` (its layers) that none of them takes fail
    here, naming the stack, not the innermost module they would reach."""
    known = set(TUNING_ARGUMENTS) | set(UNSUPPORTED_EXTRAS)
    for taker in takers:
        known |= {p.name for p in inspect.signature(taker).parameters.values() if p.kind in NAMED}
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(f"{what}: unexpected argument(s) {unknown}")


def _positional(what: str, last: str, beyond: tuple[Any, ...]) -> None:
    """SMP took its arguments positionally too, in an order its versions changed after
    ``last`` (later ones insert ``embedding_dropout_prob``, ``mask_value``): further positional
    ones fail rather than land on the wrong name."""
    if beyond:
        raise TypeError(
            f"{what}: {len(beyond)} positional argument(s) after {last!r}; SMP's versions order "
            "the later ones differently: pass them by keyword"
        )


class DistributedTransformerLayer(DistributedModule):
    """One transformer layer: ``attention`` (:class:`DistributedAttentionLayer`) then
    ``output`` (:class:`DistributedTransformerOutputLayer`). With both ``pre_layernorm`` and
    ``post_layernorm`` the attention has only its norm before, as SMP builds it.

    With ``parallel_attn_output`` (SMP's name; GPT-NeoX's ``use_parallel_residual``) both
    blocks read the layer's input, each through its own ``pre_layernorm``, and the layer returns
    their sum plus the input (the output's ``post_layernorm``, if any, after it); with
    ``single_pre_layernorm`` too both read it through the attention's norm (GPT-J's).

    ``forward((hidden_states, attention_mask))`` → ``(output, attention_mask)``, so layers
    chain in an ``nn.Sequential``."""

    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        scale_attention_scores: bool = True,
        scale_attn_by_layer_idx: bool = False,
        layer_idx: int | None = None,
        parallel_attn_output: bool = False,
        single_pre_layernorm: bool = False,
        rotary_dim: int | None = None,
        rotary_emb_base: float = 10000,
        gpt_neox_type_rotary: bool = False,
        use_qkv_bias: bool = True,
        use_attn_dense_bias: bool = True,
        mask_value: float = MASKED,
        **options: Any,
    ) -> None:
        super().__init__()
        refuse_unsupported(
            self.what, {"add_cross_attention": add_cross_attention}, {"add_cross_attention": False}
        )
        _check_layernorms(self.what, pre_layernorm, post_layernorm, single_pre_layernorm)
        pre_layernorm = pre_layernorm or single_pre_layernorm  # the one is the attention's
        if parallel_attn_output and not pre_layernorm:
            raise ValueError(
                f"{self.what}: parallel_attn_output=True needs pre_layernorm=True (each block "
                "normalizes the layer's input)"
            )
        if single_pre_layernorm and not parallel_attn_output:
            raise ValueError(
                f"{self.what}: single_pre_layernorm=True needs parallel_attn_output=True (one "
                "norm of the layer's input for both blocks)"
            )
        self.parallel = parallel_attn_output
        shared = {
            "hidden_size": hidden_size,
            "hidden_dropout_prob": hidden_dropout_prob,
            "layernorm_epsilon": layernorm_epsilon,
            "initializer_range": initializer_range,
            "use_normal_initialization": use_normal_initialization,
            "pre_layernorm": pre_layernorm,
            **options,
        }
        self.attention = DistributedAttentionLayer(
            num_attention_heads=num_attention_heads,
            attention_head_size=attention_head_size,
            attention_dropout_prob=attention_dropout_prob,
            causal_mask_size=causal_mask_size,
            post_layernorm=post_layernorm and not pre_layernorm,
            scale_attention_scores=scale_attention_scores,
            scale_attn_by_layer_idx=scale_attn_by_layer_idx,
            layer_idx=layer_idx,
            rotary_dim=rotary_dim,
            rotary_emb_base=rotary_emb_base,
            gpt_neox_type_rotary=gpt_neox_type_rotary,
            use_qkv_bias=use_qkv_bias,
            use_attn_dense_bias=use_attn_dense_bias,
            mask_value=mask_value,
            **shared,
        )
        self.output = DistributedTransformerOutputLayer(
            intermediate_size=intermediate_size,
            activation=activation,
            post_layernorm=post_layernorm,
            **{**shared, "pre_layernorm": pre_layernorm and not single_pre_layernorm},
        )
        # Each block through its module (a checkpointing mark on it applies), without its residual.
        self.attention.residual = self.output.residual = not parallel_attn_output

    def forward(self, inp: Pair) -> Pair:
        hidden_states, attention_mask = inp
        with scaled_batch(self.what, hidden_states, attention_mask) as batch:
            hidden, mask = batch.gather(hidden_states), batch.gather(attention_mask)
            if not self.parallel:
                return batch.scatter(self.output(self.attention((hidden, mask)))), attention_mask
            normed, single = hidden, self.attention.pre_layernorm
            if self.output.pre_layernorm is None and single is not None:  # one norm for both
                normed = single(hidden)
            out = self.output(normed) + self.attention((hidden, mask)) + hidden
            if self.output.layernorm is not None:
                out = self.output.layernorm(out)
            return batch.scatter(out), attention_mask


class DistributedTransformer(DistributedModule):
    """``num_layers`` :class:`DistributedTransformerLayer` in ``seq_layers``, built with the
    other arguments (SMP's: the layer's, with the same defaults). With both
    ``pre_layernorm`` and ``post_layernorm`` only the last layer has a norm after its output
    (as SMP builds it), and each layer its ``layer_idx``, counted from 0.
    ``forward((hidden_states, attention_mask))`` →
    ``(output, attention_mask)``; the tp group's batches are gathered once for all layers."""

    POSITIONAL = (
        "num_attention_heads",
        "attention_head_size",
        "hidden_size",
        "intermediate_size",
        "attention_dropout_prob",
        "hidden_dropout_prob",
        "activation",
        "layernorm_epsilon",
    )
    """The layers' arguments SMP takes after ``num_layers`` by position, in its order (every
    version's; the layer's defaults are SMP's)."""

    def __init__(
        self,
        num_layers: int = 12,
        *positional: Any,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        **layer: Any,
    ) -> None:
        super().__init__()
        _positional(self.what, self.POSITIONAL[-1], positional[len(self.POSITIONAL) :])
        twice = sorted(set(self.POSITIONAL[: len(positional)]) & set(layer))
        if twice:
            raise TypeError(f"{self.what}: got multiple values for {twice}")
        layer.update(zip(self.POSITIONAL, positional, strict=False))
        _known(self.what, layer, DistributedTransformerLayer)
        single = layer.get("single_pre_layernorm", False)
        _check_layernorms(self.what, pre_layernorm, post_layernorm, single)
        before = pre_layernorm or single
        self.seq_layers = nn.Sequential(
            *(
                DistributedTransformerLayer(
                    **layer,
                    layer_idx=i,
                    pre_layernorm=pre_layernorm,
                    post_layernorm=post_layernorm and (not before or i == num_layers - 1),
                )
                for i in range(num_layers)
            )
        )

    def forward(self, inp: Pair) -> Pair:
        hidden_states, attention_mask = inp
        with scaled_batch(self.what, hidden_states, attention_mask) as batch:
            hidden, _ = self.seq_layers((batch.gather(hidden_states), batch.gather(attention_mask)))
            return batch.scatter(hidden), attention_mask


class DistributedTransformerLMHead(DistributedModule):
    """A language model: word, position (and ``num_token_types`` > 0: token type) embeddings,
    dropout, a :class:`DistributedTransformer` (built with the other arguments, SMP's:
    ``num_layers``, ``num_attention_heads``, ``attention_head_size``, ``intermediate_size``,
    ``attention_dropout_prob``, ``activation``, ``layernorm_epsilon``,
    ``use_normal_initialization``, ``pre_layernorm``, ``post_layernorm``, ...) and, with
    ``add_lm_head``, a head tied to the word embedding. dtrain's own arguments, for Hugging
    Face translations: ``embedding_dropout_prob`` (the embeddings' dropout; None: SMP's
    ``hidden_dropout_prob``) and ``tie_word_embeddings=False`` (a head of its own, as SMP's
    ``tie_input_output_embedding=False``). SMP's ``use_positional_embedding=False`` leaves out
    the position table (for rotary attention, ``rotary_dim``), ``use_lm_head_bias`` gives the
    head a bias, ``final_layernorm`` adds a norm (``layernorm``) after the transformer,
    ``mask_value`` is what masked scores get. The embeddings and head are plain (each rank
    holds them whole and runs them on its own batch); the transformer is split. SMP's
    ``distribute_embedding=True`` is accepted with sharded data parallelism only (AWS's GPT-J
    script sets it at sdp and tp above 1): the embeddings stay plain, and FSDP2 shards them
    over the shard group as it shards everything. The first nine arguments may be positional,
    in SMP's order (its versions differ after them).

    ``forward((input_ids, attention_mask, token_type_ids, position_ids, labels))``: the mask
    is SMP's 0/1 mask over tokens (1 = attend), ``token_type_ids``, ``position_ids`` and
    ``labels`` may be None (positions then count from 0; SMP always counts from 0, dtrain uses
    given ones; without a position table they are refused). Returns the logits, or with
    ``labels`` ``(loss, logits)``: the mean cross entropy of each position's logits against the
    next position's label."""

    computes_with_own_code = ("lm_head",)
    """Children whose outputs this module's own code computes on (the loss from the head's
    logits, after the transformer's region has scattered its batch): where every rank follows
    its plan row, the automatic partition keeps them on the partition of that code. A head on
    the last blocks' partition would make a microbatch go 0 -> 1 -> 0 (the region's scatter)
    -> 1 (the head) -> 0 (the loss), which no plan serves."""

    def __init__(
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        vocab_size: int = 30522,
        num_positions: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        *beyond: Any,
        num_token_types: int = 0,
        causal_mask_size: int | None = None,
        add_lm_head: bool = True,
        initializer_range: float = 0.02,
        distribute_embedding: bool = False,
        embedding_dropout_prob: float | None = None,
        tie_word_embeddings: bool = True,
        use_positional_embedding: bool = True,
        use_lm_head_bias: bool = False,
        tie_input_output_embedding: bool = True,
        final_layernorm: bool = False,
        mask_value: float = MASKED,
        **transformer: Any,
    ) -> None:
        super().__init__()
        _positional(self.what, "hidden_dropout_prob", beyond)
        _known(self.what, transformer, DistributedTransformer, DistributedTransformerLayer)
        sharded = state.current(self.what).config["sharded_data_parallel_degree"] > 1
        if distribute_embedding and not sharded:
            raise ModelParallelError(
                f"{self.what}: distribute_embedding=True is supported by dtrain only with "
                "sharded_data_parallel_degree above 1 (there FSDP2 shards the embeddings and "
                "head over the shard group; dtrain never splits them over the tp group); "
                "allowed: False"
            )
        if causal_mask_size is not None and num_positions > causal_mask_size:
            raise ValueError(
                f"{self.what}: causal_mask_size={causal_mask_size} is below "
                f"num_positions={num_positions}; allowed: at least num_positions"
            )
        with seeded(self.what):
            self.word_embedding = nn.Embedding(vocab_size, hidden_size)
            self.position_embedding = (
                nn.Embedding(num_positions, hidden_size) if use_positional_embedding else None
            )
            self.token_type_embedding = (
                nn.Embedding(num_token_types, hidden_size) if num_token_types > 0 else None
            )
            tables = (self.word_embedding, self.position_embedding, self.token_type_embedding)
            for table in tables:
                if table is not None:
                    nn.init.normal_(table.weight, std=initializer_range)
        self.dropout = nn.Dropout(
            hidden_dropout_prob if embedding_dropout_prob is None else embedding_dropout_prob
        )
        self.transformer = DistributedTransformer(
            num_layers,
            num_attention_heads=num_attention_heads,
            attention_head_size=attention_head_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            attention_dropout_prob=attention_dropout_prob,
            hidden_dropout_prob=hidden_dropout_prob,
            causal_mask_size=causal_mask_size,
            initializer_range=initializer_range,
            mask_value=mask_value,
            **transformer,
        )
        self.mask_value = mask_value
        epsilon = transformer.get("layernorm_epsilon", 1e-5)
        self.layernorm = nn.LayerNorm(hidden_size, epsilon) if final_layernorm else None
        self.lm_head: nn.Linear | None = None
        if add_lm_head and tie_word_embeddings and tie_input_output_embedding:
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=use_lm_head_bias)
            self.lm_head.weight = self.word_embedding.weight
        elif add_lm_head:
            with seeded(self.what):
                self.lm_head = nn.Linear(hidden_size, vocab_size, bias=use_lm_head_bias)
                nn.init.normal_(self.lm_head.weight, std=initializer_range)
        if self.lm_head is not None and self.lm_head.bias is not None:
            nn.init.zeros_(self.lm_head.bias)

    def forward(
        self, inputs: tuple[torch.Tensor | None, ...]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask, token_type_ids, position_ids, labels = inputs
        assert input_ids is not None, f"{self.what}: input_ids are required"
        hidden = self.word_embedding(input_ids)
        if self.position_embedding is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            hidden = hidden + self.position_embedding(position_ids)
        elif position_ids is not None:
            raise ValueError(
                f"{self.what}: position_ids given to a model without position embeddings "
                "(use_positional_embedding=False: rotary positions count from 0); allowed: None"
            )
        if token_type_ids is not None:
            # HF GPT-2 embeds token types with the word embedding when it has no table of them.
            types = self.token_type_embedding or self.word_embedding
            hidden = hidden + types(token_type_ids)
        mask = None
        if attention_mask is not None:
            flat = attention_mask.view(input_ids.shape[0], -1).to(hidden.dtype)
            mask = (1.0 - flat[:, None, None, :]) * self.mask_value
        with scaled_batch(self.what, hidden, mask) as batch:
            # The embeddings' dropout draws its mask on the group's combined batch, under the
            # group's seed: the transformer takes its input as the same on every rank.
            combined = self.dropout(batch.gather(hidden))
            out, _ = self.transformer((combined, batch.gather(mask)))
            hidden = batch.scatter(out)
        if self.layernorm is not None:
            hidden = self.layernorm(hidden)
        if self.lm_head is None:
            return hidden
        logits = self.lm_head(hidden)
        if labels is None:
            return logits
        loss = F.cross_entropy(
            logits[..., :-1, :].reshape(-1, logits.shape[-1]), labels[..., 1:].reshape(-1)
        )
        return loss, logits

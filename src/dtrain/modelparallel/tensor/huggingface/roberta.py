"""``smp.nn.huggingface.roberta``: Hugging Face RoBERTa models split in place
(:mod:`.inplace`), as BERT's (same encoder layers).

RoBERTa numbers positions from the ``input_ids`` (padding keeps the padding position), but from
embeddings it can only count; the region embeds the ids before the base model runs, so it
derives the positions from them first, as the model would. SMP's translation functions return
their input: the model keeps HF's names.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from dtrain.modelparallel.tensor.huggingface import bert
from dtrain.modelparallel.tensor.huggingface.inplace import hooks_refused, in_place, same_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def positions(base: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    embeddings = base.embeddings
    return embeddings.create_position_ids_from_input_ids(input_ids, embeddings.padding_idx)


FAMILY = dataclasses.replace(bert.FAMILY, name="roberta", positions=positions)

translate_hf_state_dict_to_smdistributed = same_names
translate_state_dict_to_hf_roberta = same_names
translate_hf_state_dict_to_smdistributed_roberta = same_names

get_hf_roberta_transformer_hooks = hooks_refused(
    "smp.nn.huggingface.roberta.get_hf_roberta_transformer_hooks",
    "RobertaEncoder as smp.nn.DistributedTransformer",
    in_place("RoBERTa"),
)

"""Profiles of the test models, measured once on a quiet machine and kept in
``profiles.json``: the plans tests check depend on timings, and a loaded machine (a parallel
test run, CI's shared cores) measures timings that no plan should be asked to keep. Tests plan
on the recording; one test checks that today's models still profile to what was recorded,
times aside. After changing a model, the profiler's format or transformers, record again:

    python -m tests.modelparallel.profiles
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from dtrain.modelparallel.plan.profile import ModelProfile, profile_module
from tests.modelparallel.models import (
    BranchyNet,
    GroupedNet,
    ResidualTransformerLM,
    SharedLayerLM,
    TiedEncoderDecoder,
)

RECORDED = Path(__file__).with_name("profiles.json")
TIMES = ("forward_time", "forward_exclusive", "backward_time", "backward_exclusive")
"""What a profile measures (of the model and of each module); the rest is exact."""
OURS = ("grouped", "lm", "branchy", "t5like", "albertlike")
HUGGING_FACE = ("t5", "albert", "gpt2")


def measure() -> dict[str, ModelProfile]:
    """Every test model's profile, measured now (Hugging Face's with 5 timed passes); models
    and inputs come from fixed seeds, so all but the times is the same every time."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ids = torch.randint(64, (2, 16))
        profiles = {
            "grouped": profile_module(GroupedNet(), (torch.randn(4, 1, 12, 12),)),
            "lm": profile_module(ResidualTransformerLM(), (ids,), {"labels": ids}),
            "branchy": profile_module(BranchyNet(), (torch.randn(4, 8),)),
            "t5like": profile_module(TiedEncoderDecoder(), (ids,), {"labels": ids}),
            "albertlike": profile_module(SharedLayerLM(), (ids,), {"labels": ids}),
        }
        batch = {"input_ids": ids, "labels": ids}
        for name, model in _hugging_face_models().items():
            profiles[name] = profile_module(
                model, (), batch, repeats=5, loss_fn=lambda out: out.loss
            )
    return profiles


def _hugging_face_models() -> dict[str, torch.nn.Module]:
    import transformers

    small = {"vocab_size": 64, "num_attention_heads": 2}
    configs = {
        "t5": transformers.T5Config(
            d_model=32, d_kv=16, d_ff=64, num_layers=3, num_decoder_layers=3, num_heads=2,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, vocab_size=64,
        ),
        "albert": transformers.AlbertConfig(
            embedding_size=16, hidden_size=32, num_hidden_layers=4, intermediate_size=64,
            max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, **small,
        ),
        "gpt2": transformers.GPT2Config(
            n_positions=16, n_embd=32, n_layer=4, n_head=2, use_cache=False, vocab_size=64
        ),
    }  # fmt: skip
    classes = {
        "t5": transformers.T5ForConditionalGeneration,
        "albert": transformers.AlbertForMaskedLM,
        "gpt2": transformers.GPT2LMHeadModel,
    }
    models = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        models[name] = classes[name]._from_config(config, attn_implementation="eager")
    return models


def recorded() -> dict[str, ModelProfile]:
    return {
        name: ModelProfile.from_dict(data)
        for name, data in json.loads(RECORDED.read_text()).items()
    }


def untimed(profile: ModelProfile) -> dict[str, Any]:
    """Everything a profile says but its times: what a model's profile must keep."""
    data = profile.to_dict()
    for key in ("forward_time", "backward_time", "unattributed_backward_time"):
        data.pop(key)
    for module in data["modules"]:
        for key in TIMES:
            module.pop(key)
    return data


if __name__ == "__main__":
    profiles = measure()
    RECORDED.write_text(
        json.dumps({name: p.to_dict() for name, p in profiles.items()}, indent=1) + "\n"
    )
    sys.stdout.write(f"recorded {', '.join(profiles)} in {RECORDED}\n")

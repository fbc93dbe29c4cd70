"""Hugging Face GPT-2 created inside smp.tensor_parallelism() trains on two tensor-parallel
ranks like the plain HF model in one process (hf_cases' tiny GPT-2 and padded batches), and its
state dict translates to HF's and back; its config's dropout, tying and attention-scaling
options are honoured (one process: the swap is the same at any degree) or refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import swap
from dtrain.modelparallel.tensor.huggingface.gpt2 import (
    translate_hf_state_dict_to_smdistributed,
    translate_state_dict_to_hf_gpt2,
)
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import run_ranks, single_process

pytest.importorskip("transformers")

STEPS = 3


def _plain() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = hf_cases.build("gpt2")
    optimizer = torch.optim.SGD(model.parameters(), lr=hf_cases.LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(**hf_cases.CASES["gpt2"].batch(step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _distributed(delayed: bool, root: str) -> dict[str, Any]:
    """``delayed``: created without memory inside ``smp.model_creation``, as AWS's scripts do;
    the model saved whole under ``root`` after training (AWS's ``save_final_full_model``)."""
    smp.init(
        {"tensor_parallel_degree": 2, "ddp": True, "delayed_parameter_initialization": delayed}
    )
    return _train(delayed, root)


def _train(delayed: bool = False, root: str | None = None) -> dict[str, Any]:
    creation = smp.model_creation(tensor_parallelism=True) if delayed else smp.tensor_parallelism()
    with creation:
        module = hf_cases.build("gpt2")
    model = smp.DistributedModel(module)
    losses = hf_cases.train_wrapped(model, "gpt2", STEPS)
    if root is not None:
        smp.save_checkpoint(root, "fullmodel.pt", partial=False, model=model)
    return {"losses": losses, "state": model.state_dict(), "kind": type(model.module).__name__}


@pytest.mark.parametrize("delayed", [False, True])
def test_gpt2_inside_tensor_parallelism_trains_as_the_plain_model(
    delayed: bool, tmp_path: Path
) -> None:
    """The mean loss and the translated-back parameters are the plain model's, and so is the
    full checkpoint, which has HF's names (``translate_if_full``) and loads into the HF model."""
    ranks = run_ranks(2, _distributed, delayed, str(tmp_path), timeout=180, env=hf_cases.HF_ENV)
    losses, params = _plain()
    assert ranks[0]["kind"] == "DistributedTransformerLMHead"
    mean = [(ranks[0]["losses"][s] + ranks[1]["losses"][s]) / 2 for s in range(STEPS)]
    assert mean == pytest.approx(losses, rel=1e-5)
    back = translate_state_dict_to_hf_gpt2(ranks[1]["state"])
    hf_cases.build("gpt2").load_state_dict(back)  # strict: every key of the HF model
    saved = torch.load(tmp_path / "fullmodel.pt", weights_only=True)
    hf_cases.build("gpt2").load_state_dict(saved)
    assert saved.keys() == back.keys()
    for key, value in back.items():
        assert torch.equal(saved[key], value), key
    for key, value in params.items():
        torch.testing.assert_close(back[key], value, rtol=1e-4, atol=1e-6, msg=key)
    again = translate_hf_state_dict_to_smdistributed(back)
    assert again.keys() == ranks[1]["state"].keys()
    for key, value in again.items():
        assert torch.equal(value, ranks[1]["state"][key]), key


def _swapped_gpt2(**options: Any) -> tuple[Any, Any]:
    """A tiny HF GPT-2 with ``options`` and its distributed module (swapped in one process)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False, **options
    )
    torch.manual_seed(0)
    plain = GPT2LMHeadModel._from_config(config, attn_implementation="eager")
    smp.set_tensor_parallelism(plain)
    return plain, swap.distribute(plain)


def test_gpt2_config_options_are_honoured_or_refused() -> None:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with single_process({}):
        plain, dist = _swapped_gpt2(
            tie_word_embeddings=False,
            scale_attn_weights=False,
            scale_attn_by_inverse_layer_idx=True,
            embd_pdrop=0.3,
            resid_pdrop=0.0,
            attn_pdrop=0.0,
        )
        assert dist.dropout.p == 0.3
        assert dist.lm_head.weight is not dist.word_embedding.weight
        dist.eval()
        plain.eval()
        torch.testing.assert_close(dist(input_ids=ids).logits, plain(input_ids=ids).logits)
        with pytest.raises(ModelParallelError) as refused:
            _swapped_gpt2(reorder_and_upcast_attn=True)
    assert "reorder_and_upcast_attn=True is not supported by dtrain; allowed: False" in str(
        refused.value
    )


def test_gpt2_inside_tensor_parallelism_is_swapped_at_degree_one_too() -> None:
    """As SMP does: AWS's GPT-2 script reads ``transformer.seq_layers`` at any tp degree."""
    with single_process({"ddp": True}):
        result = _train()
    losses, params = _plain()
    assert result["kind"] == "DistributedTransformerLMHead"
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    back = translate_state_dict_to_hf_gpt2(result["state"])
    for key, value in params.items():
        torch.testing.assert_close(back[key], value, rtol=1e-4, atol=1e-6, msg=key)


LAYOUTS: dict[str, dict[str, Any]] = {
    "pp=2 x tp=2": {"pipeline_parallel_degree": 2, "microbatches": 2},
    "tp=2 x rdp=2": {},
}


def _in_layouts(root: str) -> dict[str, dict[str, Any]]:
    """The GPT-2 of ``_train`` in each of ``LAYOUTS``, one world of 4 (its own group made once,
    so ``smp.shutdown`` keeps it for the next layout), saved whole under ``root/{index}``."""
    torch.distributed.init_process_group("gloo")
    out = {}
    for index, (name, layout) in enumerate(LAYOUTS.items()):
        smp.init({"tensor_parallel_degree": 2, "ddp": True, **layout})
        out[name] = _train(root=f"{root}/{index}")
        smp.shutdown()
    torch.distributed.destroy_process_group()
    return out


def test_gpt2_inside_tensor_parallelism_trains_as_the_plain_model_in_pipelines_and_replicas(
    tmp_path: Path,
) -> None:
    """pp=2 x tp=2 (the tied head brings each microbatch back to partition 0) and tp=2 x rdp=2:
    the mean of the ranks' losses and the translated-back parameters are the plain model's, and
    the full checkpoint (gathered over the pipeline too) loads into the HF model with them."""
    ranks = run_ranks(4, _in_layouts, str(tmp_path), timeout=240, env=hf_cases.HF_ENV)
    losses, params = _plain()
    for index, name in enumerate(LAYOUTS):
        mean = [sum(rank[name]["losses"][s] for rank in ranks) / 4 for s in range(STEPS)]
        assert mean == pytest.approx(losses, rel=1e-5), name
        back = translate_state_dict_to_hf_gpt2(ranks[3][name]["state"])
        saved = torch.load(tmp_path / str(index) / "fullmodel.pt", weights_only=True)
        hf_cases.build("gpt2").load_state_dict(saved)
        for key, value in params.items():
            torch.testing.assert_close(back[key], value, rtol=1e-4, atol=1e-6, msg=f"{name} {key}")
            assert torch.equal(saved[key], back[key]), f"{name} {key}"


class _WithGPT2(torch.nn.Module):
    """A model holding an HF GPT-2 beside a layer of its own."""

    def __init__(self, translated: bool) -> None:
        super().__init__()
        with smp.tensor_parallelism(enabled=translated):
            self.gpt = hf_cases.build("gpt2")
        self.head = torch.nn.Linear(4, 4)


def test_a_translated_gpt2_inside_a_model_is_renamed_under_its_path(tmp_path: Path) -> None:
    """A full checkpoint renames only the translated module's keys, under its path: the file
    loads into the plain model, and resumes into the translated one."""
    root = str(tmp_path)
    with single_process({"ddp": True}):
        model = smp.DistributedModel(_WithGPT2(translated=True))
        assert type(model.module.gpt).__name__ == "DistributedTransformerLMHead"
        smp.save_checkpoint(root, "full", partial=False, model=model)
        saved = torch.load(tmp_path / "full", weights_only=True)
        plain = _WithGPT2(translated=False)
        plain.load_state_dict(saved)  # strict: every key, HF's under "gpt."
        with torch.no_grad():
            for param in plain.parameters():
                param.add_(1.0)
        torch.save(plain.state_dict(), tmp_path / "plain.pt")
        smp.resume_from_checkpoint(root, "plain.pt", partial=False)
        resumed = model.state_dict()
    expected = {"head." + k: v for k, v in plain.head.state_dict().items()}
    inside = translate_hf_state_dict_to_smdistributed(plain.gpt.state_dict())
    expected |= {"gpt." + k: v for k, v in inside.items()}
    assert resumed.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(resumed[key], value), key

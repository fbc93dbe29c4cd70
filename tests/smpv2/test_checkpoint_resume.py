"""Resume from a DCP checkpoint (issue 35's equivalence item 7): training stopped after 2 steps
and resumed from ``torch.sagemaker``'s distributed checkpoints continues exactly as the run that
never stopped, and both train like one process (:mod:`tests.smpv2.checkpoint_cases`, AdamW
with a schedule and ``clip_grad_norm_``, tiny Llama).

Saved at hybrid shard degree 2 on 2 ranks, resumed at hybrid shard degree 1 (2 ranks) and at 4
ranks (2 replicas, and hybrid shard degree 4 from a checkpoint the first replica saved alone);
tensor parallel degree 2 x hybrid shard degree 2 saved and resumed as AWS's scripts do (a folder
per tp rank). Each of AWS's checkpoint kinds: sharded (``save``), async sharded and async local
(``async_save``, finished while training went on). At every step ``clip_grad_norm_`` returns one
process's norm, under FSDP1 (either ``use_orig_params``) and FSDP2, with and without tensor
parallelism. The whole model saved as AWS's scripts save it loads strictly into the plain HF
model, and an SMP v1 full checkpoint loads into the transformed FSDP model (AWS's upgrade path).

A world of 2 gloo ranks, then one of 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.modelparallel.harness import run_ranks
from tests.smpv2.checkpoint_cases import (
    SAVED_AT,
    Resumed,
    Run,
    reference,
    train_runs,
    v1_full_checkpoint,
)
from tests.smpv2.fsdp_cases import HF_ENV, Trained
from tests.smpv2.test_fsdp import FLOAT32

pytest.importorskip("transformers")

HSD2 = {"hybrid_shard_degree": 2}
TP2_HSD2 = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
SAVED_ALL_KINDS = (("sharded", "2/s"), ("async_sharded", "2/as"), ("async_local", "2/al"))
WORLD2 = {
    "hsd2": Run(HSD2, saves=SAVED_ALL_KINDS, full="2/full"),
    "hsd1_from_sharded": Run({"hybrid_shard_degree": 1}, resume=("sharded", "2/s")),
    "hsd2_from_async_local": Run(HSD2, resume=("async_local", "2/al")),
    "fully_shard": Run(HSD2, fsdp="fsdp2", steps=1),
    "flat_params": Run(HSD2, fsdp="fsdp1_flat", steps=1),
}
TP = {"tensor_parallel": True}
WORLD4 = {
    "4_ranks_from_async_sharded": Run(HSD2, resume=("async_sharded", "2/as")),
    "hsd2x2": Run(HSD2, saves=(("sharded", "4/s"),)),
    "hsd4_from_first_replica": Run({"hybrid_shard_degree": 4}, resume=("sharded", "4/s")),
    "tp": Run(
        TP2_HSD2,
        **TP,
        saves=(("sharded", "4/tp-s"), ("async_local", "4/tp-al"), ("over_world", "4/wrong")),
        full="4/tp-full",
    ),
    "tp_from_sharded": Run(TP2_HSD2, **TP, resume=("sharded", "4/tp-s")),
    "tp_from_async_local": Run(TP2_HSD2, **TP, resume=("async_local", "4/tp-al")),
    "tp_fully_shard": Run(TP2_HSD2, **TP, fsdp="fsdp2", steps=1),
    "tp_from_v1": Run(TP2_HSD2, **TP, resume=("v1_full", "v1/llama.pt")),
}
RESUMED = {
    "hsd1_from_sharded": "hsd2",
    "hsd2_from_async_local": "hsd2",
    "4_ranks_from_async_sharded": "hsd2",
    "hsd4_from_first_replica": "hsd2x2",
    "tp_from_sharded": "tp",
    "tp_from_async_local": "tp",
}
"""Each resumed run, and the uninterrupted run that saved its checkpoint."""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def v1_state(root: Path) -> dict[str, torch.Tensor]:
    return v1_full_checkpoint(root / "v1" / "llama.pt")


@pytest.fixture(scope="module")
def runs(root: Path, v1_state: dict[str, torch.Tensor]) -> dict[str, Resumed]:
    two = run_ranks(2, train_runs, list(WORLD2.values()), str(root), timeout=300, env=HF_ENV)
    four = run_ranks(4, train_runs, list(WORLD4.values()), str(root), timeout=400, env=HF_ENV)
    return dict(zip([*WORLD2, *WORLD4], two[0] + four[0], strict=True))


@pytest.fixture(scope="module")
def one_process() -> Trained:
    return reference("llama")


def assert_close_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **FLOAT32, msg=name)


@pytest.mark.parametrize("name", ["hsd2", "hsd2x2", "tp"])
def test_the_uninterrupted_runs_train_like_one_process(
    runs: dict[str, Resumed], one_process: Trained, name: str
) -> None:
    got = runs[name]
    torch.testing.assert_close(got.losses, one_process.losses, **FLOAT32)
    torch.testing.assert_close(got.norms, one_process.extra["norms"], **FLOAT32)
    assert_close_params(got.params, one_process.params)


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_a_resumed_run_continues_as_the_uninterrupted_one(
    runs: dict[str, Resumed], one_process: Trained, name: str
) -> None:
    """The step after the checkpoint has the uninterrupted run's loss and norm (the weights
    came back) and its final parameters (AdamW's moments and step, and the schedule too)."""
    got, whole = runs[name], runs[RESUMED[name]]
    assert got.loaded == {"total_steps": SAVED_AT}
    torch.testing.assert_close(got.losses, whole.losses[SAVED_AT:], **FLOAT32)
    torch.testing.assert_close(got.norms, whole.norms[SAVED_AT:], **FLOAT32)
    assert_close_params(got.params, whole.params)
    assert_close_params(got.params, one_process.params)


@pytest.mark.parametrize("name", ["fully_shard", "flat_params", "tp_fully_shard"])
def test_clip_grad_norm_returns_one_process_norm(
    runs: dict[str, Resumed], one_process: Trained, name: str
) -> None:
    """FSDP2's DTensors (strided over tp slices with tensor parallelism) and FSDP1's flat
    parameters themselves (``use_orig_params=False``); the runs above cover FSDP1's original
    parameters, tp slices and hybrid shard degree 1."""
    got = runs[name]
    torch.testing.assert_close(got.norms, one_process.extra["norms"][:1], **FLOAT32)
    torch.testing.assert_close(got.losses, one_process.losses[:1], **FLOAT32)


def test_one_folder_for_every_tp_rank_is_refused(runs: dict[str, Resumed]) -> None:
    """Every rank saving its tp slices into one folder would keep one slice of each tensor:
    refused, naming the fix."""
    (refusal,) = set(runs["tp"].refusals)
    assert "saved over ranks [0, 1, 2, 3]" in refusal
    assert "each tp rank's folder over its shard group" in refusal


@pytest.mark.parametrize("name", ["hsd2", "tp"])
def test_the_full_checkpoint_loads_strictly_into_the_plain_hf_model(
    runs: dict[str, Resumed], root: Path, name: str
) -> None:
    """AWS's ``save_final_model``: ``pytorch_model.bin`` and ``config.json`` from rank 0,
    tensor-parallel parameters whole (SMP's translation back to HF's format)."""
    from transformers import AutoConfig, LlamaForCausalLM

    folder = root / {**WORLD2, **WORLD4}[name].full  # type: ignore[operator]
    plain = LlamaForCausalLM._from_config(AutoConfig.from_pretrained(folder))
    saved = torch.load(folder / "pytorch_model.bin", weights_only=True)
    plain.load_state_dict(saved, strict=True)
    assert_close_params(dict(plain.state_dict()), runs[name].params)


def test_an_smp_v1_full_checkpoint_loads_into_the_transformed_fsdp_model(
    runs: dict[str, Resumed], v1_state: dict[str, torch.Tensor]
) -> None:
    """AWS's upgrade path: v1's full checkpoint (HF's names) loaded into the v2 model (tp 2 x
    hybrid shard 2) as a full state dict trains on as the plain model loaded with it does."""
    got = runs["tp_from_v1"]
    assert got.loaded == {"keys": len(v1_state)}
    expected = reference("llama", SAVED_AT, v1_state)
    torch.testing.assert_close(got.losses, expected.losses, **FLOAT32)
    torch.testing.assert_close(got.norms, expected.extra["norms"], **FLOAT32)
    assert_close_params(got.params, expected.params)

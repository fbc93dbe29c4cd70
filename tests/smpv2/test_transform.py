"""``torch.sagemaker.transform`` (:mod:`dtrain.smpv2.transform`) at tp 2 on gloo, every family of
:mod:`tests.smpv2.models` in one world of two ranks: each trains like the plain HF model in one
process (logits and whole gradients, one step), its whole state dict has HF's names and loads
into the plain model, an HF state dict loads into it, rank 0's weights reach the other rank's
meta model with ``load_state_dict_from_rank0``, and a meta model made by ``DelayedParamIniter``
holds eager creation's values. Rank ``r`` creates its eager model under seed ``r``: the group
trains the first rank's model. FSDP2 over a data-parallel dimension composes with the split;
what cannot be honoured fails by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.smpv2.delayed_param import DelayedParamIniter
from dtrain.smpv2.layer import TransformerLayer
from dtrain.smpv2.transform import transform
from tests.modelparallel.harness import run_ranks
from tests.smpv2.models import CASES, HF_ENV, Case, step

pytest.importorskip("transformers")

CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict, by torch's own gathering of DTensors."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model.base_model.layers)


def _case(case: Case, mesh: DeviceMesh) -> dict[str, Any]:
    rank = dist.get_rank()
    model = transform(case.build(seed=rank), mesh)
    out: dict[str, Any] = {
        "split": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
        "layers": all(isinstance(layer, TransformerLayer) for layer in _layers(model)),
        "step": step(model, case),
        "state": _full(model),
    }
    loaded = transform(case.build(seed=5), mesh)
    loaded.load_state_dict(case.build(seed=0).state_dict())
    out["loaded"] = _full(loaded)
    from_rank0 = transform(
        case.build(seed=0, meta=rank != 0), mesh, load_state_dict_from_rank0=True
    )
    out["from_rank0"] = (_full(from_rank0), step(from_rank0, case)[0])
    torch.manual_seed(0)  # as the reference seeds before it creates eagerly
    delayed = transform(case.build(meta=True), mesh)
    initer = DelayedParamIniter(delayed)
    out["draw"] = torch.rand(4)  # the generator as eager creation leaves it
    init = initer.get_param_init_fn()
    with initer.validate_params_and_buffers_inited():
        for module in delayed.modules():
            init(module)
    out["delayed"] = _full(delayed)
    return out


def _fsdp2(case: Case) -> dict[str, Any]:
    """The split under FSDP2 on a (data, tp) mesh of one data-parallel rank."""
    from torch.distributed.fsdp import fully_shard

    root = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = transform(case.build(seed=0), root["tp"])
    for layer in _layers(model):
        fully_shard(layer, mesh=root["dp"])
    fully_shard(model, mesh=root["dp"])
    two_d = sorted(n for n, p in model.named_parameters() if p.device_mesh.ndim == 2)
    return {"two_d": two_d, "step": step(model, case)}


def _refused(mesh: DeviceMesh) -> dict[str, str]:
    """Each misuse's message, raised on every rank alike."""
    messages = {}
    attempts = {
        "heads": lambda: transform(CASES["llama3"].build(num_key_value_heads=1), mesh),
        "meta_on_one_rank": lambda: transform(
            CASES["llama3"].build(meta=dist.get_rank() == 1), mesh
        ),
        "rank0_on_meta": lambda: transform(
            CASES["llama3"].build(meta=True), mesh, load_state_dict_from_rank0=True
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except ModelParallelError as exc:
            messages[name] = str(exc)
    return messages


def _on_ranks() -> dict[str, Any]:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    results: dict[str, Any] = {name: _case(case, mesh) for name, case in CASES.items()}
    results["fsdp2"] = _fsdp2(CASES["llama3"])
    results["refused"] = _refused(mesh)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(2, _on_ranks, timeout=300, env=HF_ENV)


def _reference(case: Case) -> nn.Module:
    return case.build(seed=0)


@pytest.mark.parametrize("name", CASES)
def test_trains_like_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    case = CASES[name]
    logits, grads = step(_reference(case), case)
    for rank in ranks:
        got_logits, got_grads = rank[name]["step"]
        torch.testing.assert_close(got_logits, logits, **CLOSE)
        assert got_grads.keys() == grads.keys()
        for key, grad in grads.items():
            torch.testing.assert_close(got_grads[key], grad, **CLOSE, msg=key)


@pytest.mark.parametrize("name", CASES)
def test_splits_attention_feed_forward_and_embeddings(
    ranks: list[dict[str, Any]], name: str
) -> None:
    split = ranks[0][name]["split"]
    assert ranks[0][name]["layers"] and ranks[1][name]["layers"]
    embeddings = {"gpt_neox.embed_in.weight", "embed_out.weight", "model.embed_tokens.weight"}
    assert embeddings & set(split)
    assert any(".q_proj." in key or ".query_key_value." in key for key in split)
    feed_forward = any(".mlp." in key for key in split)
    assert feed_forward == (name != "mixtral")  # Mixtral's experts stay whole
    assert not any("norm" in key for key in split)


@pytest.mark.parametrize("name", CASES)
def test_state_dict_has_hf_names_both_ways(ranks: list[dict[str, Any]], name: str) -> None:
    reference = _reference(CASES[name])
    expected = reference.state_dict()
    for rank in ranks:
        for kind in ("state", "loaded"):
            got = rank[name][kind]
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    plain = CASES[name].build(seed=5)
    plain.load_state_dict(ranks[1][name]["state"])  # strict: HF's names, whole tensors
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", CASES)
def test_load_state_dict_from_rank0_reaches_a_meta_rank(
    ranks: list[dict[str, Any]], name: str
) -> None:
    reference = _reference(CASES[name])
    logits, _ = step(reference, CASES[name])
    for rank in ranks:
        state, got_logits = rank[name]["from_rank0"]
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(got_logits, logits, **CLOSE)


@pytest.mark.parametrize("name", CASES)
def test_delayed_creation_gives_eager_values(ranks: list[dict[str, Any]], name: str) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = CASES[name].build(seed=None)
        draw = torch.rand(4)
    for rank in ranks:
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(rank[name]["delayed"][key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(rank[name]["draw"], draw, rtol=0, atol=0)


def test_composes_with_fsdp2_over_a_data_parallel_dimension(ranks: list[dict[str, Any]]) -> None:
    case = CASES["llama3"]
    logits, grads = step(_reference(case), case)
    for rank in ranks:
        assert rank["fsdp2"]["two_d"] == rank["llama3"]["split"]  # on (data, tp); others (data)
        got_logits, got_grads = rank["fsdp2"]["step"]
        torch.testing.assert_close(got_logits, logits, **CLOSE)
        for key, grad in grads.items():
            torch.testing.assert_close(got_grads[key], grad, **CLOSE, msg=key)


def test_what_cannot_be_split_fails_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        refused = rank["refused"]
        assert (
            "num_key_value_heads=1 does not split over tensor_parallel_degree=2"
            in (refused["heads"])
        )
        assert (
            "ranks [1] of tp group [0, 1] created the model on the meta device"
            in (refused["meta_on_one_rank"])
        )
        assert (
            "load_state_dict_from_rank0=True, but rank 0's model is on the meta"
            in (refused["rank0_on_meta"])
        )

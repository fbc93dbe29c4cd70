"""``DelayedParamIniter`` (:mod:`dtrain.smpv2.delayed_param`) in one process: a model created on
the meta device and made module by module, as FSDP's ``param_init_fn`` makes it, holds eager
creation's values and leaves the generator where eager creation does; a script's own
``init_method_using_config`` is counted; what was not made fails the validation by name. At
tp 2, transformed and under FSDP2, in ``test_transform.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.modelparallel.errors import ModelParallelError
from dtrain.smpv2.delayed_param import DelayedParamIniter
from tests.smpv2.models import CASES

pytest.importorskip("transformers")


def _make_all(initer: DelayedParamIniter, model: nn.Module) -> None:
    init = initer.get_param_init_fn()
    with initer.validate_params_and_buffers_inited():
        for module in model.modules():
            init(module)


@pytest.mark.parametrize("name", ["gptneox", "llama31_tied", "mixtral"])
def test_meta_model_gets_eager_values_and_random_stream(name: str) -> None:
    case = CASES[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        eager = case.build(seed=None)
        eager_draw = torch.rand(5)
        torch.manual_seed(3)
        model = case.build(meta=True)
        initer = DelayedParamIniter(model)
        draw = torch.rand(5)
        _make_all(initer, model)
    assert torch.equal(draw, eager_draw)
    tensors = dict(model.named_buffers()) | model.state_dict()
    for key, value in (dict(eager.named_buffers()) | eager.state_dict()).items():
        torch.testing.assert_close(tensors[key], value, rtol=0, atol=0, msg=key)
    if name == "llama31_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_module_not_made_fails_the_validation_by_name() -> None:
    model = CASES["llama3"].build(meta=True)
    initer = DelayedParamIniter(model)
    init = initer.get_param_init_fn()
    not_made = pytest.raises(AssertionError, match=r"not made: lm_head.weight; still on the meta")
    with not_made, initer.validate_params_and_buffers_inited():
        for module in model.modules():
            if module is not model.lm_head:
                init(module)
    with pytest.raises(ModelParallelError, match="not a module of the model it was made for"):
        init(nn.Linear(2, 2))


def test_made_otherwise_fails_the_validation() -> None:
    """Tensors made real by something else (``to_empty``: no values) are not this initer's."""
    model = CASES["llama3"].build(meta=True)
    initer = DelayedParamIniter(model)
    none_made = pytest.raises(AssertionError, match=r"0 of \d+ parameters made by its param_init")
    with none_made, initer.validate_params_and_buffers_inited():
        model.to_empty(device="cpu")


def test_a_scripts_own_initialisation_is_counted() -> None:
    model = CASES["gptneox"].build(meta=True)

    def init_method_using_config(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)
        for param in module.parameters(recurse=False):
            nn.init.constant_(param, 0.5)

    initer = DelayedParamIniter(model, init_method_using_config=init_method_using_config)
    _make_all(initer, model)
    assert all(torch.all(param == 0.5) for param in model.parameters())


def test_the_post_init_function_ties_weights_again() -> None:
    model = CASES["llama31_tied"].build(seed=0)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    DelayedParamIniter(model).get_post_param_init_fn()(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    DelayedParamIniter(model).get_post_param_init_fn()(model.lm_head)  # no tie_weights: nothing


def test_an_eager_model_needs_nothing_and_draws_nothing() -> None:
    model = CASES["llama3"].build(seed=0)
    with torch.random.fork_rng(devices=[]):
        before = torch.random.get_rng_state()
        initer = DelayedParamIniter(model)
        assert torch.equal(torch.random.get_rng_state(), before)
    _make_all(initer, model)


def test_a_model_whose_creation_is_unknown_needs_a_scripts_initialisation() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ModelParallelError, match="pass init_method_using_config"):
        DelayedParamIniter(model)

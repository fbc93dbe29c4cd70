"""smp.amp.GradScaler: an inf/NaN on one pipeline stage makes every stage skip the step; with
sharded data parallelism it unscales the sharded (DTensor) gradients and trains like one
process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import NotInitializedError
from tests.modelparallel.harness import run_ranks
from tests.modelparallel.models import ResidualTransformerLM


def _scaled_steps() -> list[dict[str, Any]]:
    smp.init({"pipeline_parallel_degree": 2})
    me = smp.rank()
    param = torch.nn.Parameter(torch.ones(2))  # this stage's share of the model
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = smp.amp.GradScaler(init_scale=4.0, growth_interval=1000)
    history = []
    # step 0: rank 1 overflows; step 1: all finite; step 2: rank 0 has no gradient at all
    for step, broken in enumerate((1, None, 1)):
        optimizer.zero_grad()
        if not (step == 2 and me == 0):
            scaler.scale((param * torch.tensor([1.0, 2.0])).sum()).backward()
        if me == broken:
            param.grad[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        history.append({"param": param.detach().tolist(), "scale": scaler.get_scale()})
    return history


def test_found_inf_is_agreed_by_every_rank() -> None:
    for history in run_ranks(2, _scaled_steps):
        assert history == [
            {"param": [1.0, 1.0], "scale": 2.0},  # skipped everywhere, scale backed off
            {"param": [0.5, 0.0], "scale": 2.0},  # unscaled gradient [1, 2] applied
            {"param": [0.5, 0.0], "scale": 1.0},  # skipped again, though rank 0 had nothing
        ]


def test_scaler_needs_init() -> None:
    with pytest.raises(NotInitializedError, match=r"smp\.amp\.GradScaler"):
        smp.amp.GradScaler()


def _only_the_loss_rank_scales() -> list[float]:
    smp.init({"pipeline_parallel_degree": 2})
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = smp.amp.GradScaler(init_scale=4.0)
    loss = (param * torch.tensor([1.0, 2.0])).sum()
    if smp.pp_rank() == 0:  # inside @smp.step, only the leader holds the loss
        scaler.scale(loss).backward()
    else:  # the later stage gets the scaled gradient through the pipeline
        (loss * 4.0).backward()
    scaler.step(optimizer)
    scaler.update()
    return param.detach().tolist()


def test_a_stage_that_never_scales_a_loss_still_steps() -> None:
    assert run_ranks(2, _only_the_loss_rank_scales) == [[0.5, 0.0], [0.5, 0.0]]


HUGE_AT = 1
"""The step whose loss is multiplied by 1e30: its fp16 gradients overflow."""


def _ids(step: int) -> Tensor:
    return torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(100 + step))


def _autocast_loss(model: torch.nn.Module, ids: Tensor, step: int) -> Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(ids, labels=ids)["loss"]
    return loss * 1e30 if step == HUGE_AT else loss


def _sharded_autocast() -> tuple[list[float], dict[str, Tensor]]:
    smp.init(
        {
            "ddp": True,
            "sharded_data_parallel_degree": 2,
            "sdp_param_persistence_threshold": 1000,
            "sdp_gradient_clipping": 0.0,
        }
    )
    model = smp.DistributedModel(ResidualTransformerLM(seed=0))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler(init_scale=1024.0)

    @smp.step
    def train_step(model: smp.DistributedModel, ids: Tensor, step: int) -> Tensor:
        loss = _autocast_loss(model, ids, step)
        model.backward(scaler.scale(loss))
        return loss

    scales = []
    for step in range(3):
        optimizer.zero_grad()
        train_step(model, _ids(step).chunk(2)[smp.dp_rank()], step)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    params = model.state_dict()
    smp.shutdown()
    return scales, params


def test_sharded_autocast_trains_like_one_process_with_torch_grad_scaler() -> None:
    model = ResidualTransformerLM(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(_autocast_loss(model, _ids(step), step)).backward()
        scaler.step(optimizer)
        scaler.update()
    for scales, params in run_ranks(2, _sharded_autocast):
        assert scales == [1024.0, 512.0, 512.0]  # the overflow skipped and backed off
        for name, value in model.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-4, msg=name)

"""``smp.optimizers.FusedLAMB`` against LAMB written out from its definition (no processes).

The reference follows You et al., 2019 ("Large Batch Optimization for Deep Learning: Training
BERT in 76 minutes", Algorithm 2) with apex's ``FusedLAMB`` options: the global-norm clipping
of the gradients first, L2 (``adam_w_mode=False``) or decoupled weight decay, the trust ratio
``|p| / |u|`` only with weight decay (or ``use_nvlamb``) and where both norms are non-zero. It
runs in float64, one parameter at a time, on tensors the optimizer never sees.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import dtrain.modelparallel as smp
from dtrain.errors import DtrainError
from dtrain.modelparallel.optimizers import FusedLAMB
from tests.modelparallel.harness import single_process

SHAPES = [(4, 3), (3,), (2, 2, 2)]
STEPS = 4


def _start() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator) for shape in SHAPES]
    params[1].zero_()  # a zero parameter: its trust ratio falls back to the learning rate
    return params


def _gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) * (step + 1) for shape in SHAPES]


def reference(options: dict[str, Any], decays: list[float]) -> list[torch.Tensor]:
    """LAMB by its definition, in float64; ``decays``: each parameter's weight decay."""
    lr, (beta1, beta2), eps = options["lr"], options["betas"], options["eps"]
    params = [p.double() for p in _start()]
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    for step in range(1, STEPS + 1):
        grads = [g.double() for g in _gradients(step - 1)]
        global_norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        if global_norm > options["max_grad_norm"]:
            grads = [g / (global_norm / options["max_grad_norm"]) for g in grads]
        for i, (p, g, decay) in enumerate(zip(params, grads, decays, strict=True)):
            if not options["adam_w_mode"]:
                g = g + decay * p
            beta3 = 1 - beta1 if options["grad_averaging"] else 1.0
            exp_avg[i] = beta1 * exp_avg[i] + beta3 * g
            exp_avg_sq[i] = beta2 * exp_avg_sq[i] + (1 - beta2) * g * g
            first, second = (1 - beta1**step, 1 - beta2**step)
            if not options["bias_correction"]:
                first, second = 1.0, 1.0
            u = (exp_avg[i] / first) / ((exp_avg_sq[i] / second).sqrt() + eps)
            if options["adam_w_mode"]:
                u = u + decay * p
            ratio = lr
            p_norm, u_norm = float(p.norm()), float(u.norm())
            if (options["use_nvlamb"] or decay != 0) and p_norm > 0 and u_norm > 0:
                ratio = lr * p_norm / u_norm
            params[i] = p - ratio * u
    return params


def trained(options: dict[str, Any], decays: list[float]) -> list[torch.Tensor]:
    """FusedLAMB on fp32 parameters; a param group per weight decay, as AWS's BERT script
    makes them."""
    params = [torch.nn.Parameter(p) for p in _start()]
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for param, decay in zip(params, decays, strict=True):
        groups.setdefault(decay, []).append(param)
    kept = {k: v for k, v in options.items() if k != "weight_decay"}
    optimizer = FusedLAMB(
        [{"params": ps, "weight_decay": decay} for decay, ps in groups.items()], **kept
    )
    for step in range(STEPS):
        for param, grad in zip(params, _gradients(step), strict=True):
            param.grad = grad
        optimizer.step()
    return [p.detach() for p in params]


APEX = {
    "lr": 0.01,
    "betas": (0.9, 0.999),
    "eps": 1e-6,
    "bias_correction": True,
    "adam_w_mode": True,
    "grad_averaging": True,
    "max_grad_norm": 1.0,
    "use_nvlamb": False,
}
"""apex's defaults, but for the learning rate (so that the steps show)."""


@pytest.mark.parametrize(
    ("changes", "decays"),
    [
        ({}, [0.01, 0.0, 0.01]),  # AWS's BERT groups: decay on weights, none on biases
        ({}, [0.01, 0.01, 0.01]),
        ({"adam_w_mode": False}, [0.1, 0.1, 0.0]),
        ({"use_nvlamb": True}, [0.0, 0.0, 0.0]),
        ({}, [0.0, 0.0, 0.0]),  # no decay, no nvlamb: the ratio is the learning rate
        ({"grad_averaging": False, "bias_correction": False}, [0.01, 0.0, 0.01]),
        ({"max_grad_norm": 1e9}, [0.01, 0.0, 0.01]),  # never clipped
        ({"betas": (0.8, 0.99), "eps": 1e-3}, [0.05, 0.0, 0.05]),
    ],
)
def test_fused_lamb_steps_as_lamb_written_out(changes: dict[str, Any], decays: list[float]) -> None:
    options = {**APEX, **changes}
    expected = reference(options, decays)
    got = trained(options, decays)
    for index, (value, wanted) in enumerate(zip(got, expected, strict=True)):
        assert not torch.equal(value, _start()[index]), "the step moved nothing"
        torch.testing.assert_close(value, wanted.float(), rtol=1e-5, atol=1e-6)


def test_without_decay_clipping_or_nvlamb_it_is_adam() -> None:
    """An independent check of the moments and the bias correction: torch's Adam."""
    params = [torch.nn.Parameter(p) for p in _start()]
    adams = [torch.nn.Parameter(p) for p in _start()]
    lamb = FusedLAMB(params, lr=0.01, weight_decay=0.0, max_grad_norm=math.inf)
    adam = torch.optim.Adam(adams, lr=0.01, eps=1e-6)
    for step in range(STEPS):
        for a, b, grad in zip(params, adams, _gradients(step), strict=True):
            a.grad, b.grad = grad.clone(), grad.clone()
        lamb.step()
        adam.step()
    for a, b in zip(params, adams, strict=True):
        torch.testing.assert_close(a, b)


def test_apex_behaviour_around_the_step() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB([param], amsgrad=True)
    optimizer = FusedLAMB([param])
    param.grad = torch.ones(3)
    optimizer.zero_grad()
    assert param.grad is None  # set_grad_none, apex's default
    param.grad = torch.ones(3)
    FusedLAMB([param], set_grad_none=False).zero_grad()
    assert param.grad is not None and not param.grad.any()
    param.grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        optimizer.step()
    param.grad = torch.ones(3)
    optimizer.step()
    saved = optimizer.state_dict()
    assert saved["param_groups"][0]["step"] == 1 and set(saved["state"][0]) == {
        "exp_avg",
        "exp_avg_sq",
    }
    again = FusedLAMB([torch.nn.Parameter(torch.ones(3))])
    again.load_state_dict(saved)
    assert again.param_groups[0]["step"] == 1


def test_smp_serves_it_and_refuses_it_where_the_global_norm_would_be_wrong() -> None:
    assert smp.optimizers.FusedLAMB is FusedLAMB
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    refused = pytest.raises(DtrainError, match="FusedLAMB with shard_optimizer_state")
    with single_process({"shard_optimizer_state": True, "ddp": True}), refused:
        FusedLAMB([param]).step()
    with single_process({}):  # in a job: the same update
        optimizer = FusedLAMB([param], lr=0.1)
        optimizer.step()
    assert not torch.equal(param.detach(), torch.ones(3))

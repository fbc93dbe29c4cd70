"""``torch.sagemaker.grad_norm.clip_grad_norm_`` in one process: the norm and the clipped
gradients are torch's ``clip_grad_norm_``'s, for the norms scripts use. Over sharded and
tensor-parallel gradients on several ranks: :mod:`tests.smpv2.test_checkpoint_resume`."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.sagemaker.grad_norm import clip_grad_norm_


def model_with_gradients() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)  # a parameter without a gradient
    model(torch.randn(5, 4)).pow(2).sum().backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_it_clips_as_torch_does(norm_type: float, max_norm: float) -> None:
    mine, torchs = model_with_gradients(), model_with_gradients()
    got = clip_grad_norm_(mine, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(torchs.parameters(), max_norm, norm_type)
    torch.testing.assert_close(got, want)
    for a, b in zip(mine.parameters(), torchs.parameters(), strict=True):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad)


def nan_gradient() -> nn.Module:
    model = model_with_gradients()
    model[2].weight.grad[0, 0] = math.nan
    return model


def test_a_nonfinite_norm_fails_when_asked() -> None:
    assert clip_grad_norm_(nan_gradient(), 1.0).isnan()
    with pytest.raises(RuntimeError, match=r"total norm of order 2\.0 of the gradients is nan"):
        clip_grad_norm_(nan_gradient(), 1.0, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="norm_type must be positive or inf"):
        clip_grad_norm_(nan_gradient(), 1.0, norm_type=0)

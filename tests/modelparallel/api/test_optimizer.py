"""smp.DistributedOptimizer's state follows its parameter, as torch's optimizers need it.

A checkpoint is usually resumed before the first step, when the parameters are still where the
script made them (the CPU); partitioning then moves them to the rank's GPU. Without a GPU the
move is played by a change of dtype, which torch's optimizers reject alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.api.optimizer import placed
from tests.modelparallel.harness import single_process, sum_step


@pytest.mark.parametrize("flags", [{}, {"capturable": True}, {"fused": True}])
def test_state_is_placed_as_torch_places_it(flags: dict[str, Any]) -> None:
    trained = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(trained.parameters())
    trained(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()  # float32 on the CPU, step a CPU tensor
    saved["param_groups"][0].update(flags)
    params = [
        nn.Parameter(torch.empty_like(p, dtype=torch.float16, device="meta"))
        for p in trained.parameters()
    ]
    loaded = torch.optim.Adam(params)  # torch's own placement (fused is checked at step only)
    loaded.load_state_dict(saved)
    for index, param in enumerate(params):
        ours = placed(param, saved["state"][index], saved["param_groups"][0])
        assert ours.keys() == loaded.state[param].keys()
        for key, value in ours.items():
            theirs = loaded.state[param][key]
            assert (value.device, value.dtype) == (theirs.device, theirs.dtype), key


def test_state_loaded_before_the_first_step_follows_its_parameter(tmp_path: Path) -> None:
    step = sum_step()
    with single_process():
        model = smp.DistributedModel(nn.Linear(3, 2))
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters()))
        step(model, torch.ones(2, 3))
        optimizer.step()
        smp.save_checkpoint(tmp_path, "t", model=model, optimizer=optimizer)
        smp.reset()

        model = smp.DistributedModel(nn.Linear(3, 2))
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters()))
        smp.resume_from_checkpoint(tmp_path)  # before the first step: the state is on the CPU
        model.module.double()  # what partitioning does to the parameters, moving them to a GPU
        step(model, torch.ones(2, 3, dtype=torch.float64))
        optimizer.step()
        for param in model.parameters():
            state = optimizer.state[param]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float64
            assert (state["step"].dtype, state["step"].item()) == (torch.float32, 2.0)

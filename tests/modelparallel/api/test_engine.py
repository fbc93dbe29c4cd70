"""What both engines share (:mod:`dtrain.modelparallel.api.engine`): one rule for averaging
gradients, one overflow agreement, one strict-load check, the DTensor helpers on plain tensors,
and a pipelined model without tensor parallelism that never imports DTensor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from dtrain.modelparallel.api.precision import overflowed
from dtrain.modelparallel.api.state_dicts import check_keys
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.tensor import averages, dtensors

DP, TP, RDP = "dp group", "tp group", "rdp group"


def _state(tp: int, rdp: int = 2, prescaled: bool = False) -> Any:
    return SimpleNamespace(
        tp_size=tp,
        rdp_size=rdp,
        config={"prescaled_batch": prescaled},
        dp_process_group=DP,
        tp_process_group=TP,
        rdp_process_group=RDP,
    )


def _params() -> tuple[nn.Parameter, nn.Parameter]:
    """A plain parameter and a distributed module's, each with a gradient."""
    plain, scaled = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    plain.grad, scaled.grad = torch.ones(2), torch.ones(3)
    setattr(scaled, averages.SCALED_BATCH, True)
    return plain, scaled


def _shown(result: list[averages.Average]) -> list[tuple[Any, int | None, list[int]]]:
    return [(a.group, a.divisor, [g.numel() for g in a.grads]) for a in result]


@pytest.mark.parametrize(
    ("tp", "prescaled", "pipelined", "sharded"),
    [
        (1, False, [(DP, None, [2, 3])], []),
        (2, False, [(DP, None, [2]), (RDP, 4, [3])], [(TP, None, [2]), (None, 2, [3])]),
        (2, True, [(DP, None, [2]), (RDP, 2, [3])], [(TP, None, [2])]),
    ],
)
def test_both_engines_average_by_one_rule(
    tp: int, prescaled: bool, pipelined: list[Any], sharded: list[Any]
) -> None:
    """The pipelines average over the dp group (a scaled-batch gradient: summed over the rdp
    group, divided by its distinct batches); FSDP2 has taken the rdp mean, which the sharded
    engine completes over the tp group (a scaled-batch gradient: divided by the tp batches).
    At tp 1 a distributed module's parameters average as plain ones."""
    st = _state(tp, prescaled=prescaled)
    assert _shown(averages.averages(list(_params()), st, rdp_mean_taken=False)) == pipelined
    assert _shown(averages.averages(list(_params()), st, rdp_mean_taken=True)) == sharded


def test_an_overflow_is_found_in_any_gradient_and_the_rest_unscaled() -> None:
    finite = [torch.full((2,), 4.0), torch.full((3,), 8.0, dtype=torch.float64)]
    assert overflowed(finite, 0.5, torch.device("cpu"), None).item() == 0.0
    assert torch.equal(finite[0], torch.full((2,), 2.0))
    assert torch.equal(finite[1], torch.full((3,), 4.0, dtype=torch.float64))
    inf = [torch.ones(2), torch.tensor([1.0, float("nan")], dtype=torch.float64)]
    assert overflowed(inf, 1.0, torch.device("cpu"), None).item() == 1.0


def test_a_strict_load_names_missing_and_unexpected_keys() -> None:
    check_keys({"a", "b"}, wanted={"a"}, known={"a", "b"})
    with pytest.raises(ModelParallelError) as caught:
        check_keys({"a", "z"}, wanted={"a", "b"}, known={"a", "b"})
    assert str(caught.value) == "load_state_dict: missing keys ['b'], unexpected keys ['z']"


def test_a_plain_tensor_is_its_own_part_and_whole() -> None:
    tensor = torch.arange(4.0)
    assert not dtensors.is_distributed(tensor)
    assert dtensors.local(tensor) is tensor and dtensors.whole(tensor) is tensor
    saved = dtensors.saved(tensor, full=True)
    assert torch.equal(saved, tensor) and saved.requires_grad is False
    assert dtensors.saved(3, full=False) == 3
    value = torch.zeros(4, dtype=torch.float64)
    assert dtensors.laid_out_as("state", tensor, value, whole_value=True) is value
    dtensors.load_into("'w'", tensor, torch.ones(4), whole_value=True)
    assert torch.equal(tensor, torch.ones(4))


@pytest.mark.parametrize("whole_value", [True, False])
def test_a_saved_value_of_another_shape_is_refused_naming_it(whole_value: bool) -> None:
    kind = "full" if whole_value else "partial"
    with pytest.raises(ModelParallelError, match=rf"^'w' has shape \(3,\) in the {kind} state"):
        dtensors.load_into("'w'", torch.zeros(4), torch.ones(3), whole_value)


LAZY = """
import sys, torch
from torch import nn
import dtrain.modelparallel as smp
from tests.modelparallel.harness import single_process

with single_process({"pipeline_parallel_degree": 1, "microbatches": 2, "fp16": True}):
    model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))

    @smp.step
    def train(model, x, y):
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    train(model, torch.randn(4, 4), torch.randn(4, 2))
    model.load_state_dict(model.state_dict())
    model.load_state_dict(model.local_state_dict())
heavy = ("torch.distributed.tensor", "torch.distributed.fsdp")
print(sorted(name for name in sys.modules if name.startswith(heavy)))
"""


def test_a_pipelined_model_without_tensor_parallelism_imports_no_dtensor() -> None:
    """DTensor and FSDP2 take a second to import: a pipelined fp16 model without tensor
    parallelism steps, gathers and loads its state without them (torch's optimizers import
    them on their own, through torch.compile's machinery)."""
    root = Path(__file__).resolve().parents[3]
    command = [sys.executable, "-c", LAZY]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=root)
    assert done.stdout.strip().splitlines()[-1] == "[]"

"""``@smp.step``: how arguments are split into microbatches and what the step returns."""

from __future__ import annotations

import inspect
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.api.step import StepOutput, split_arguments, split_value
from dtrain.modelparallel.errors import MicrobatchSplitError, ModelParallelError
from tests.modelparallel.harness import single_process

Batch = namedtuple("Batch", "x y")


class Rows:
    """A user type that splits itself (SMP's ``smp_slice`` protocol)."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def smp_slice(self, num_mb: int, mb: int, axis: int) -> Rows:
        size = len(self.rows) // num_mb
        return Rows(self.rows[mb * size : (mb + 1) * size])


def test_containers_are_split_inside_and_keep_their_types() -> None:
    value = {"a": (torch.arange(4), [torch.arange(8).view(4, 2)]), "n": 3}
    first, second = split_value(value, 2, 0, "value")
    assert torch.equal(first["a"][0], torch.tensor([0, 1])) and first["n"] == 3
    assert isinstance(first["a"], tuple) and isinstance(first["a"][1], list)
    assert torch.equal(second["a"][1][0], torch.tensor([[4, 5], [6, 7]]))
    halves = split_value(Batch(torch.arange(4), torch.arange(4) * 2), 2, 0, "batch")
    assert isinstance(halves[1], Batch) and halves[1].y.tolist() == [4, 6]


def test_scalars_and_plain_values_go_whole_and_objects_slice_themselves() -> None:
    assert split_value(torch.tensor(1.5), 2, 0, "s") == [torch.tensor(1.5)] * 2
    assert split_value("tag", 3, 0, "t") == ["tag"] * 3
    assert [r.rows for r in split_value(Rows([1, 2, 3, 4]), 2, 0, "r")] == [[1, 2], [3, 4]]


def test_split_tensors_go_to_the_leader_device_and_unsplit_inputs_stay() -> None:
    """The meta device stands for the leader's GPU."""
    meta = torch.device("meta")
    pieces = split_value({"x": torch.ones(4, 2), "s": torch.tensor(2.0), "n": 3}, 2, 0, "b", meta)
    assert [(p["x"].device, p["x"].shape, p["s"].device, p["n"]) for p in pieces] == [
        (meta, (2, 2), meta, 3)
    ] * 2

    def body(x: Tensor, lengths: Tensor) -> None: ...

    lengths = torch.tensor([3, 1, 2, 2])  # pack_padded_sequence wants them on the CPU
    bound = inspect.signature(body).bind(torch.ones(4, 2), lengths)
    calls = split_arguments(bound, 2, ["lengths"], {}, meta)
    assert [(args[0].device, args[1]) for args, _ in calls] == [(meta, lengths)] * 2


def test_split_errors_name_the_argument() -> None:
    with pytest.raises(MicrobatchSplitError, match=r"'batch\[1\]' has batch size 3"):
        split_value((torch.zeros(4), torch.zeros(3)), 2, 0, "batch")
    with pytest.raises(MicrobatchSplitError, match="cannot be split along axis 2"):
        split_value(torch.zeros(4, 2), 2, 2, "x")


def test_options_must_name_arguments_of_the_step() -> None:
    with pytest.raises(ModelParallelError, match="'mask' is not an argument of body"):

        @smp.step(non_split_inputs=["mask"])
        def body(model: Any, x: Tensor) -> None: ...

    with pytest.raises(ModelParallelError, match="'seq' is not an argument"):

        @smp.step(input_split_axes={"seq": 1})
        def other(model: Any, x: Tensor) -> None: ...


def test_called_form_with_unsplit_inputs_and_split_axes() -> None:
    with single_process({"microbatches": 2}):
        model = smp.DistributedModel(nn.Linear(3, 3))

        @smp.step(non_split_inputs=["mask"], input_split_axes={"seq_first": 1})
        def body(
            model: smp.DistributedModel, x: Tensor, mask: Tensor, seq_first: Tensor, tag: str
        ) -> Any:
            return {
                "out": model(x),
                "sizes": (x.shape[0], mask.shape[0], tuple(seq_first.shape)),
                "tag": tag,
            }

        result = body(model, torch.ones(4, 3), torch.ones(4), torch.zeros(5, 4), "run")
    assert isinstance(result["out"], StepOutput) and len(result["out"]) == 2
    assert result["out"].concat().shape == (4, 3) and result["out"].stack().shape == (2, 2, 3)
    # Containers are assembled element by element; a non-tensor leaf becomes a per-microbatch list.
    assert result["sizes"] == ([2, 2], [4, 4], ([5, 5], [2, 2]))
    assert result["tag"] == ["run", "run"]
    losses = StepOutput([torch.tensor(1.0), torch.tensor(3.0)])
    assert losses.reduce_mean().item() == 2.0 and losses.reduce_sum().item() == 4.0

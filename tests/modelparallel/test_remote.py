"""Deferred remote calls: values that stay with their owner, chains, one backward per chain."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.remote import (
    DEFER_ENV,
    RemoteValue,
    call_signature,
    deferred_outputs,
    materialize,
    predictable,
    same_structure,
)
from dtrain.modelparallel.transport import OutputRef, TensorRef, flatten
from tests.modelparallel.harness import run_ranks, train_steps
from tests.modelparallel.models import seeded

Pair = namedtuple("Pair", "first second")


class _Runtime:
    """Stands in for the pipeline runtime: ``fetch`` hands out a known tensor."""

    def __init__(self, value: Tensor) -> None:
        self.value = value
        self.fetches = 0

    def fetch(self, record: Any, path: tuple[Any, ...]) -> Tensor:
        self.fetches += 1
        return self.value


class _Record:
    def __init__(self, runtime: _Runtime, owner: int = 1, call_id: int = 7) -> None:
        self.runtime, self.owner, self.call_id = runtime, owner, call_id


def _value(tensor: Tensor) -> tuple[RemoteValue, _Runtime]:
    runtime = _Runtime(tensor)
    return RemoteValue(_Record(runtime), (0,)), runtime  # type: ignore[arg-type]


def test_only_containers_tensors_and_none_are_predicted() -> None:
    assert predictable((TensorRef(0), None, {"a": [TensorRef(1)]}))
    assert predictable(Pair(TensorRef(0), None))
    assert not predictable((TensorRef(0), 3))
    assert not predictable("text")


def test_structures_compare_by_type_and_shape() -> None:
    assert same_structure((TensorRef(0), None), (TensorRef(0), None))
    assert not same_structure((TensorRef(0), None), [TensorRef(0), None])
    assert not same_structure((TensorRef(0), None), (TensorRef(0), TensorRef(1)))
    assert not same_structure(Pair(TensorRef(0), None), (TensorRef(0), None))
    assert not same_structure({"a": TensorRef(0)}, {"b": TensorRef(0)})


def test_signature_names_the_module_and_the_non_tensor_arguments() -> None:
    sent = ((TensorRef(0),), {"scale": 0.5})
    referenced = ((OutputRef(3, (0,)),), {"scale": 0.5})
    assert call_signature("pair", sent) == call_signature("pair", referenced)
    assert call_signature("pair", sent) != call_signature("pair", ((TensorRef(0),), {"scale": 1}))
    assert call_signature("pair", sent) != call_signature("other", sent)


def test_deferred_outputs_keep_the_predicted_containers() -> None:
    record = _Record(_Runtime(torch.zeros(1)))
    outputs = deferred_outputs(record, Pair(TensorRef(0), {"x": [TensorRef(1), None]}))  # type: ignore[arg-type]
    assert isinstance(outputs, Pair) and outputs.second["x"][1] is None
    assert outputs.first.reference_for(1) == OutputRef(7, (0,))
    assert outputs.second["x"][0].reference_for(1) == OutputRef(7, (1, "x", 0))
    assert outputs.first.reference_for(2) is None  # another rank's module: it must be fetched


@pytest.mark.parametrize(
    "use",
    [
        lambda v, t: v + t,
        lambda v, t: t * v,
        lambda v, t: torch.relu(v) + t,
        lambda v, t: F.linear(v, torch.eye(3)),
        lambda v, t: torch.cat([v, t]),
        lambda v, t: v[1:] * 1,
        lambda v, t: v.sum(),
        lambda v, t: torch.tensor(v.shape, dtype=torch.float),
        lambda v, t: torch.tensor([float(v[0])]),
    ],
)
def test_any_use_fetches_the_value(use: Any) -> None:
    tensor, other = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.5, 0.5])
    value, runtime = _value(tensor)
    assert torch.equal(use(value, other), use(tensor, other))
    assert runtime.fetches == 1


def test_a_fetched_value_is_no_longer_passed_by_reference() -> None:
    tensor = torch.tensor([1.0, 2.0])
    value, runtime = _value(tensor)
    value.mul_(2)  # changed here: the owner's copy is stale, so it must travel as data
    assert value.reference_for(1) is None
    assert torch.equal(tensor, torch.tensor([2.0, 4.0]))
    assert torch.equal(materialize({"v": [value]})["v"][0], tensor) and runtime.fetches == 1


def test_flatten_leaves_references_in_place() -> None:
    structure, tensors = flatten(((OutputRef(1, ()), torch.ones(1)), {}))
    assert structure == ((OutputRef(1, ()), TensorRef(0)), {}) and len(tensors) == 1


# --- on two ranks ------------------------------------------------------------------------------

WIDTH, LAYERS, BATCH, STEPS, MICROBATCHES = 6, 3, 8, 4, 2


class ChainNet(nn.Module):
    """A stem on partition 0, then layers called one by one from the root, all on partition 1."""

    def __init__(self) -> None:
        super().__init__()

        def build() -> nn.ModuleDict:
            return nn.ModuleDict(
                {
                    "stem": nn.Linear(WIDTH, WIDTH),
                    "layers": nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)),
                    "head": nn.Linear(WIDTH, 2),
                }
            )

        parts = seeded(0, build)
        self.stem, self.layers, self.head = parts["stem"], parts["layers"], parts["head"]

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = torch.tanh(layer(h)) if layer is self.layers[-1] else layer(h)
        return self.head(h)


class ChangingNet(nn.Module):
    """``part`` returns a tensor on its first call and a tuple afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.part = _Changing()

    def forward(self, x: Tensor) -> Tensor:
        out = self.part(x)
        return out.sum() if isinstance(out, RemoteValue | Tensor) else out[0].sum()


class _Changing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.calls = 0

    def forward(self, x: Tensor) -> Any:
        self.calls += 1
        return x * self.weight if self.calls == 1 else (x * self.weight, None)


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 2, (BATCH,), generator=g)


def _train_chain() -> dict[str, Any]:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    module = ChainNet()
    for layer in module.layers:
        smp.set_partition(layer, 1)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    batches = (_batch(step) for step in range(STEPS))
    losses = train_steps(model, optimizer, batches, F.cross_entropy)
    return {"losses": losses, "params": model.state_dict(), "timeline": model.timeline()}


def _reference() -> list[float]:
    model = ChainNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("defer", ["1", "0"])
def test_a_chain_of_calls_runs_on_its_owner_with_one_backward(defer: str) -> None:
    leader, other = run_ranks(2, _train_chain, timeout=120, env={DEFER_ENV: defer})
    assert leader["losses"] == pytest.approx(_reference(), rel=1e-5)
    assert other["params"].keys() == leader["params"].keys()
    backwards = [e for e in other["timeline"] if e.kind == "B"]
    forwards = [e for e in other["timeline"] if e.kind == "F"]
    assert len(forwards) == LAYERS * MICROBATCHES  # every layer ran on its owner
    # Deferred: the chain of layers is one backward per microbatch; eager: one per layer call.
    per_microbatch = 1 if defer == "1" else LAYERS
    assert len(backwards) == per_microbatch * MICROBATCHES, backwards


def _changing_structure() -> str:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    module = ChangingNet()
    smp.set_partition(module.part, 1)
    model = smp.DistributedModel(module)

    @smp.step
    def forward(model: smp.DistributedModel, x: Tensor) -> Tensor:
        return model(x)

    forward(model, torch.ones(2))
    try:
        forward(model, torch.ones(2))
    except ModelParallelError as error:
        return str(error)
    return "no error"


def test_an_output_structure_that_changes_fails_the_step_and_says_why() -> None:
    leader, _ = run_ranks(2, _changing_structure, timeout=60)
    assert "module 'part' returned (tensor, None)" in leader
    assert "previous call" in leader and f"{DEFER_ENV}=0" in leader


class DictNet(nn.Module):
    """``part`` (partition 1) returns a dict with a tensor, ``None`` and a tuple of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.part = seeded(0, lambda: _DictPart())

    def forward(self, x: Tensor) -> Tensor:
        out = self.part(x)
        assert out["aux"] is None and isinstance(out["pair"], tuple)
        return (out["h"] * out["pair"][1]).mean()


class _DictPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> dict[str, Any]:
        h = self.linear(x)
        return {"h": h, "aux": None, "pair": (x, torch.tanh(h))}


def _dict_batches() -> list[Tensor]:
    return [torch.randn(4, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]


def _train_dict_outputs() -> list[float]:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    module = DictNet()
    smp.set_partition(module.part, 1)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    @smp.step
    def train_step(model: smp.DistributedModel, x: Tensor) -> Tensor:
        loss = model(x)
        model.backward([loss], [torch.tensor(2.0)])  # grad_tensors: twice the loss's gradient
        return loss

    losses = []
    for x in _dict_batches():
        optimizer.zero_grad()
        losses.append(float(train_step(model, x).reduce_mean()))
        optimizer.step()
    return losses


def test_dict_outputs_cross_partitions_and_backward_takes_gradients() -> None:
    leader, _ = run_ranks(2, _train_dict_outputs, timeout=60)
    model = DictNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = []
    for x in _dict_batches():
        optimizer.zero_grad()
        loss = model(x)
        (2 * loss).backward()
        optimizer.step()
        expected.append(loss.item())
    assert leader == pytest.approx(expected, rel=1e-5)

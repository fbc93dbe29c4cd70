"""Deferred remote calls: values that stay with their owner, chains, one backward per chain."""

from __future__ import annotations

import itertools
import threading
import time
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.modules.unfetched import materialize
from dtrain.modelparallel.pipeline.remote import (
    RemoteValue,
    call_signature,
    deferred_outputs,
    predictable,
    same_structure,
)
from dtrain.modelparallel.transport.message import OutputRef, TensorRef
from dtrain.modelparallel.transport.structure import flatten
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


def _train_chain(slow: bool = False) -> dict[str, Any]:
    """ChainNet (``slow``: its last layer's weight gradient takes 0.3 s) on 2 ranks."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    module = _slow_chain() if slow else ChainNet()
    for layer in module.layers:
        smp.set_partition(layer, 1)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    batches = (_batch(step) for step in range(STEPS))
    losses = train_steps(model, optimizer, batches, F.cross_entropy)
    split = model.pipeline_schedule().policy.split
    return {"losses": losses, "params": model.state_dict(), "timeline": model.timeline(),
            "split": split}  # fmt: skip


def _reference(model: nn.Module | None = None, steps: int = STEPS) -> list[float]:
    """Single-process losses of ``model`` (a ChainNet by default) on the same batches."""
    model = ChainNet() if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_chain_of_calls_runs_on_its_owner_with_one_backward() -> None:
    leader, other = run_ranks(2, _train_chain, timeout=120)
    assert leader["losses"] == pytest.approx(_reference(), rel=1e-5)
    assert other["params"].keys() == leader["params"].keys()
    backwards = [e for e in other["timeline"] if e.kind in ("B", "I")]
    forwards = [e for e in other["timeline"] if e.kind == "F"]
    assert len(forwards) == LAYERS * MICROBATCHES  # every layer ran on its owner
    # Deferred: the chain of layers is one backward per microbatch.
    assert len(backwards) == MICROBATCHES, backwards
    # The plan's split backwards (the step's last ones) send their inputs' gradients (I)
    # before the weights' (W), which may run in several periods (more urgent work goes first).
    split = range(MICROBATCHES - other["split"][1], MICROBATCHES)
    assert len(split) > 0
    inputs = [e for e in other["timeline"] if e.kind == "I"]
    assert sorted(e.microbatch for e in inputs) == sorted(split)
    for mb in split:
        weights = [e for e in other["timeline"] if e.kind == "W" and e.microbatch == mb]
        assert min(e.start for e in inputs if e.microbatch == mb) < weights[0].start


class _SlowGradient(torch.autograd.Function):
    """The identity, whose gradient takes 0.3 s: a weight gradient that comes late."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor) -> Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(0.3)
        return grad


class _SlowLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, _SlowGradient.apply(self.weight), self.bias)


def _slow_chain() -> ChainNet:
    """ChainNet whose last layer's weight gradient takes 0.3 s."""
    module = ChainNet()
    slow = _SlowLinear(WIDTH, WIDTH)
    slow.load_state_dict(module.layers[-1].state_dict())
    module.layers[-1] = slow
    return module


def test_a_split_backward_replies_first_and_ends_the_step_after_its_weights() -> None:
    """Split, the last microbatches' backwards on partition 1 reply before their weight
    halves, which take 0.3 s each: the leader's own backward runs meanwhile, and partition 1
    still does not return from the step (and run its optimizer step) before its weight
    gradients are in: otherwise the losses would drift from single-process training."""
    leader, other = run_ranks(2, _train_chain, True, timeout=120)
    assert leader["losses"] == pytest.approx(_reference(_slow_chain()), rel=1e-5)
    weights = [e for e in other["timeline"] if e.kind == "W"]
    last = MICROBATCHES - 1
    halves = {mb: [e for e in weights if e.microbatch == mb] for mb in range(MICROBATCHES)}
    assert sum(e.duration for e in halves[last]) >= 0.3
    stem_backward = [e for e in leader["timeline"] if e.kind == "B" and e.microbatch == last]
    assert stem_backward and min(e.start for e in stem_backward) < halves[last][-1].end


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
    assert "previous call" in leader and "pass what decides it as a non-tensor" in leader


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


# --- messages per microbatch, failures of deferred calls, the sticky token --------------------


class LossNet(nn.Module):
    """Two stem modules on partition 0, then layers and a loss head on partition 1: the loss
    the leader gets is deferred, so ``model.backward`` fetches it with its backward."""

    def __init__(self) -> None:
        super().__init__()

        def build() -> nn.ModuleDict:
            return nn.ModuleDict(
                {
                    "stem_a": nn.Linear(WIDTH, WIDTH),
                    "stem_b": nn.Linear(WIDTH, WIDTH),
                    "layers": nn.ModuleList(
                        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)
                    ),
                    "head": _LossHead(),
                }
            )

        parts = seeded(0, build)
        self.stem_a, self.stem_b = parts["stem_a"], parts["stem_b"]
        self.layers, self.head = parts["layers"], parts["head"]

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.stem_b(torch.relu(self.stem_a(x)))
        for layer in self.layers:
            h = layer(h)
        return self.head(h, y)


class _LossHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, 2)

    def forward(self, h: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self.proj(h), y)


def _train_loss_net(pipeline: str) -> dict[str, Any]:
    from dtrain.modelparallel.transport import wire as transport

    streams: list[str] = []
    send_all = transport.Transport.send_all

    def counting(self: Any, dst: int, items: list[Any]) -> None:
        streams.append("+".join(message.kind for message, _ in items))
        send_all(self, dst, items)

    transport.Transport.send_all = counting  # type: ignore[method-assign]
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": pipeline,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    module = LossNet()
    for part in (*module.layers, module.head):
        smp.set_partition(part, 1)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model: smp.DistributedModel, x: Tensor, y: Tensor) -> Tensor:
        loss = model(x, y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(STEPS):
        streams.clear()  # keep the last step's: every call deferred by then
        optimizer.zero_grad()
        losses.append(float(train_step(model, *_batch(step)).reduce_mean()))
        optimizer.step()
    return {"losses": losses, "streams": list(streams), "timeline": model.timeline()}


def _reference_loss_net() -> list[float]:
    model = LossNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(*_batch(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_a_remote_loss_costs_one_message_each_way_per_microbatch(pipeline: str) -> None:
    leader, other = run_ranks(2, _train_loss_net, pipeline, timeout=120)
    assert leader["losses"] == pytest.approx(_reference_loss_net(), rel=1e-5)
    # The layers' and the head's calls go with the loss's backward request, in one message
    # (simple: before the microbatch waits for the others' forwards, the backward after, except
    # for the last to finish its forward, which waits for nobody); the owner answers once (the
    # loss, and the gradient of what the leader sent).
    forwards = "+".join(["forward"] * (LAYERS + 1))
    together = [f"{forwards}+backward"]
    apart = [forwards, "backward"] if pipeline == "simple" else together
    assert sorted(leader["streams"]) == sorted(["end_step", *apart * 3, *together])
    assert other["streams"] == ["reply"] * 4
    # The sticky token: a microbatch's two stem modules run back to back on the leader, unless
    # a more urgent (lower) microbatch takes the token in between.
    stems = [(e.name, e.microbatch) for e in leader["timeline"] if e.kind == "F"]
    assert sorted(stems) == [(n, mb) for n in ("stem_a", "stem_b") for mb in range(4)]
    for (name, mb), (next_name, next_mb) in itertools.pairwise(stems):
        if name == "stem_a":
            assert (next_name, next_mb) == ("stem_b", mb) or next_mb < mb, stems
    # Microbatches take the token in order when they start (not as their threads happen to).
    assert [mb for name, mb in stems if name == "stem_a"] == list(range(4)), stems


class _FailsLater(nn.Module):
    """Returns its input times a weight on its first call; raises on its second."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 2:
            raise ValueError("the side branch broke on its second call")
        return x * self.weight


class SideNet(nn.Module):
    """``side`` (partition 1) fails on its second call; ``use_side`` says if the loss uses it."""

    def __init__(self, use_side: bool) -> None:
        super().__init__()
        self.use_side = use_side
        self.main = nn.Linear(2, 1)
        self.side = _FailsLater()

    def forward(self, x: Tensor) -> Tensor:
        side = self.side(x)
        out = self.main(x).sum()
        return out + side.sum() if self.use_side else out


def _side_failure(use_side: bool) -> str:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    module = SideNet(use_side)
    smp.set_partition(module.side, 1)
    model = smp.DistributedModel(module)

    @smp.step
    def forward(model: smp.DistributedModel, x: Tensor) -> Tensor:
        return model(x)

    forward(model, torch.ones(1, 2))
    try:
        forward(model, torch.ones(1, 2))
    except ModelParallelError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("use_side", [True, False])
def test_a_failing_deferred_call_reports_its_own_error(use_side: bool) -> None:
    """Used or not, a deferred call's failure comes back as its own error (not as the error of
    a later request about its outputs); an unused one when its microbatch ends."""
    leader, _ = run_ranks(2, _side_failure, use_side, timeout=60)
    assert "ValueError" in leader and "broke on its second call" in leader, leader


class _Middle(nn.Module):
    """On partition 2; calls ``inner``, which is on partition 1 (a nested remote call)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.inner(x)))


class NestedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = seeded(0, lambda: nn.Linear(WIDTH, WIDTH))
        self.middle = seeded(1, _Middle)

    def forward(self, x: Tensor) -> Tensor:
        return self.middle(torch.relu(self.first(x)))


def _train_nested_with_a_late_step_end() -> list[float]:
    """Partition 1 gets the leader's step ends late: partition 2's requests of the next step
    reach it first (messages from different peers are not ordered)."""
    from dtrain.modelparallel.pipeline.dispatch import Dispatcher
    from dtrain.modelparallel.transport.message import END_STEP

    smp.init({"pipeline_parallel_degree": 3, "microbatches": 2,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    if smp.pp_rank() == 1:
        put = Dispatcher.put

        def late(dispatcher: Dispatcher[Any], stream: Any) -> None:
            if stream[0][0].kind == END_STEP:
                threading.Timer(0.5, put, (dispatcher, stream)).start()
            else:
                put(dispatcher, stream)

        Dispatcher.put = late  # type: ignore[method-assign]
    module = NestedNet()
    smp.set_partition(module.middle, 2)
    smp.set_partition(module.middle.inner, 1)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return train_steps(model, optimizer, (_batch(step) for step in range(3)), F.cross_entropy)


def test_a_request_of_the_next_step_waits_for_the_end_of_the_current_one() -> None:
    """Served before partition 1 had run its optimizer step, the nested call would use stale
    weights and the losses would drift from single-process training."""
    leader, _, _ = run_ranks(3, _train_nested_with_a_late_step_end, timeout=120)
    assert leader == pytest.approx(_reference(NestedNet(), steps=3), rel=1e-5)

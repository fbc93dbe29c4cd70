"""Backward in two halves gives exactly what one backward gives, on graphs of several shapes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dtrain.modelparallel.pipeline.split_backward import backward_giving_way, backward_inputs_first


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build()


class Stage(nn.Module):
    """Two transformer layers and a loss head: a pipeline's last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.head = nn.Linear(16, 5)

    def forward(self, h: Tensor, y: Tensor) -> tuple[Tensor, ...]:
        for block in self.blocks:
            h = block(h)
        return (nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten()),)


class Tied(nn.Module):
    """One linear layer on two branches (its weight reached from two nodes, neither below the
    other), and a chunk (an operation with two outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.out = nn.Linear(3, 1)

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, ...]:
        a, b = (self.shared(x) * self.shared(torch.tanh(x))).chunk(2, dim=-1)
        return ((self.out(a * b) - y).pow(2).mean(),)


class Recurrent(Tied):
    """The linear layer applied to its own output: the weight's second use lies below its first
    on the input path."""

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, ...]:
        a, b = self.shared(torch.tanh(self.shared(x))).chunk(2, dim=-1)
        return ((self.out(a * b) - y).pow(2).mean(),)


class TwoOutputs(nn.Module):
    """An output that depends on the input, and one that depends on weights only; an input
    that is not used at all."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor, unused: Tensor) -> tuple[Tensor, ...]:
        return self.lin(x) * self.bias, (self.bias * 3).exp()


class Checkpointed(Stage):
    """Reentrant activation checkpointing around a block, before and after another: its
    backward refuses ``autograd.grad``."""

    reentrant = True

    def forward(self, h: Tensor, y: Tensor) -> tuple[Tensor, ...]:
        h = checkpoint(self.blocks[0], h, use_reentrant=self.reentrant)
        h = self.blocks[1](h)
        return (nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten()),)


class NonReentrant(Checkpointed):
    """Non-reentrant checkpointing: each autograd call recomputes the region."""

    reentrant = False


def _inputs(model: nn.Module) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)
    if isinstance(model, Stage):
        return [
            torch.randn(3, 4, 16, generator=generator),
            torch.randint(0, 5, (3, 4), generator=generator),
        ]
    if isinstance(model, Tied):  # and Recurrent
        return [torch.randn(5, 6, generator=generator), torch.randn(5, 1, generator=generator)]
    return [torch.randn(2, 4, generator=generator), torch.randn(2, 4, generator=generator)]


def _run(model: nn.Module, split: bool) -> tuple[list[Tensor | None], dict[str, Tensor]]:
    """Input gradients and accumulated weight gradients of one backward, starting from
    existing gradients (a backward accumulates). Split, the input half must leave the weights
    alone, unless it ran the whole backward (the weight half is empty)."""
    for index, param in enumerate(model.parameters()):
        param.grad = torch.full_like(param, 0.5 * index)
    inputs = _inputs(model)
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    wanted = [t for t in leaves if t.requires_grad]
    outputs = model(*leaves)
    grads = [torch.rand(out.shape, generator=torch.Generator().manual_seed(2)) for out in outputs]
    if split:
        input_grads, weights = backward_inputs_first(outputs, grads, wanted, model.parameters())
        untouched = all(
            torch.equal(p.grad, torch.full_like(p, 0.5 * i))
            for i, p in enumerate(model.parameters())
        )
        assert untouched == bool(weights.groups), "the input half accumulated into a weight"
        weights.run()
        assert not weights.groups
    else:
        torch.autograd.backward(outputs, grads)
        input_grads = [t.grad for t in wanted]
    return input_grads, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "build",
    [Stage, Tied, Recurrent, TwoOutputs, Checkpointed, NonReentrant],
    ids=lambda b: b.__name__,
)
def test_two_halves_give_what_one_backward_gives(build: Callable[[], nn.Module]) -> None:
    model = _seeded(build)
    whole_inputs, whole_weights = _run(model, split=False)
    split_inputs, split_weights = _run(model, split=True)
    assert len(whole_inputs) == len(split_inputs)
    for whole, split in zip(whole_inputs, split_inputs, strict=True):
        if whole is None:
            assert split is None
        else:
            assert split is not None
            torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-7)
    assert whole_weights.keys() == split_weights.keys()
    for name, grad in whole_weights.items():
        torch.testing.assert_close(split_weights[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_each_group_of_weights_runs_once_and_unused_inputs_get_none() -> None:
    """A weight used on two branches is one group (one autograd call reaches it); used again
    below its first use, the backward runs whole; an unused input gets None."""
    model = _seeded(Tied)
    x = _inputs(model)[0].requires_grad_()
    (loss,) = model(x, torch.zeros(5, 1))
    (grad,), weights = backward_inputs_first([loss], [torch.ones(())], [x], model.parameters())
    assert grad is not None and all(p.grad is None for p in model.parameters())
    reached = [{id(w) for w in group.weights} for group in weights.groups]
    shared = {id(model.shared.weight), id(model.shared.bias)}
    assert [ids for ids in reached if ids & shared] == [shared]
    assert len(weights.groups) == 2  # shared.weight+bias, out.weight+bias

    model = _seeded(Recurrent)
    x = _inputs(model)[0].requires_grad_()
    (loss,) = model(x, torch.zeros(5, 1))
    (grad,), weights = backward_inputs_first([loss], [torch.ones(())], [x], model.parameters())
    assert grad is not None and x.grad is None and not weights.groups
    assert all(p.grad is not None for p in model.parameters())

    model = _seeded(TwoOutputs)
    x, unused = (t.requires_grad_() for t in _inputs(model))
    outputs = model(x, unused)
    grads, weights = backward_inputs_first(
        outputs, [torch.ones(2, 4), torch.ones(4)], [x, unused], model.parameters()
    )
    assert grads[0] is not None and grads[1] is None
    assert all(p.grad is None for p in model.parameters())
    weights.run()
    assert all(p.grad is not None for p in model.parameters())


class _Counted(torch.autograd.Function):
    """Doubles ``x``; takes a helper leaf (as the runtime's remote fetches do); counts its
    backward calls."""

    calls = 0

    @staticmethod
    def forward(ctx: object, helper: Tensor, x: Tensor) -> Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, Tensor]:
        _Counted.calls += 1
        return torch.zeros(0), grad * 2


def test_a_leaf_that_is_not_a_weight_does_not_make_a_node_run_twice() -> None:
    lin = _seeded(lambda: nn.Linear(3, 3))
    x = torch.ones(2, 3, requires_grad=True)
    helper = torch.empty(0, requires_grad=True)
    loss = lin(_Counted.apply(helper, x)).sum()
    _Counted.calls = 0
    (grad,), weights = backward_inputs_first([loss], [torch.ones(())], [x], lin.parameters())
    weights.run()
    assert _Counted.calls == 1 and helper.grad is None
    torch.testing.assert_close(grad, 2 * lin.weight.sum(0).expand(2, 3))
    assert lin.weight.grad is not None and lin.bias.grad is not None


def test_a_checkpointed_region_is_recomputed_once() -> None:
    """Split into one call per weight group, each call would recompute the region again."""
    model = _seeded(NonReentrant)
    calls = []
    model.blocks[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    _run(model, split=True)
    assert len(calls) == 2, "the forward and one recomputation"


def test_a_backward_giving_way_stops_at_each_weight_and_gives_what_backward_gives() -> None:
    """The leader's terminal backward lets other work compute before every node that
    accumulates into a weight; its gradients are those of one ordinary backward."""
    stage = _seeded(Stage)
    h = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (2, 3), generator=torch.Generator().manual_seed(2))
    (loss,) = stage(h, y)
    loss.backward()
    expected = {name: p.grad.clone() for name, p in stage.named_parameters()}
    stage.zero_grad()
    stops: list[int] = []
    (loss,) = stage(h, y)
    backward_giving_way([loss], [None], lambda: stops.append(len(stops)))
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0, msg=name)
    # At least one stop per layer with weights (2 blocks of 4 linear maps and 2 norms, a head).
    assert len(stops) >= 2 * 6 + 1

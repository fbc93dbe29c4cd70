"""Forward hooks on submodules another partition runs: recorded there, run where registered."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrain.modelparallel as smp
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.pipeline.hooks import Unavailable, hooked_submodules, recording, replay
from dtrain.modelparallel.transport.structure import flatten
from tests.modelparallel.equivalence import init_smp
from tests.modelparallel.harness import run_ranks, sum_step


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: Tensor, scale: float = 1.0, note: object = None) -> Tensor:
        del note  # an argument of a kind that does not travel with records
        return torch.tanh(self.inner(x)) * scale


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = _Block()
        self.second = _Block()

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.first(x), scale=2.0)


def _named(model: nn.Module) -> dict[str, nn.Module]:
    return dict(model.named_modules())


def _recorded_calls(model: nn.Module, x: Tensor, names: list[str]) -> Any:
    """Run ``model`` recording ``names``; the records as they travel (structure, tensors)."""
    with recording(_named(model), names) as records:
        model(x)
    return flatten(records)


def test_recorded_calls_run_the_hooks_of_another_copy_in_order() -> None:
    owner, caller = _Net(), _Net()
    x = torch.randn(3, 4, requires_grad=True)
    seen: list[tuple[str, Tensor, Tensor]] = []
    for name in ("first.inner", "second.inner"):
        module = caller.get_submodule(name)
        module.register_forward_pre_hook(lambda m, args, n=name: seen.append((n, args[0], None)))
        module.register_forward_hook(lambda m, args, out, n=name: seen.append((n, args[0], out)))
    structure, tensors = _recorded_calls(owner, x, ["first.inner", "second.inner"])
    replay(_named(caller), structure, tensors, [t.requires_grad for t in tensors], set())
    assert [(n, out is None) for n, _, out in seen] == [
        ("first.inner", True),
        ("first.inner", False),
        ("second.inner", True),
        ("second.inner", False),
    ]
    torch.testing.assert_close(seen[1][2], owner.first.inner(x))
    with pytest.raises(ModelParallelError, match="recorded values carry no gradient"):
        seen[1][2].sum().backward()


def test_values_that_do_not_travel_are_marked_unavailable() -> None:
    owner = _Net()
    structure, _ = _recorded_calls(owner, torch.randn(2, 4), ["second"])
    ((_, _, kwargs, _),) = structure
    assert kwargs == {"scale": 2.0}
    with recording(_named(owner), ["first"]) as records:
        owner.first(torch.randn(2, 4), note=owner)
    assert records[0][2] == {"note": Unavailable("_Net")}


def test_a_hook_that_replaces_a_value_fails_unless_the_owner_ran_it() -> None:
    owner, caller = _Net(), _Net()
    caller.first.inner.register_forward_hook(lambda m, args, out: out * 0)
    structure, tensors = _recorded_calls(owner, torch.randn(2, 4), ["first.inner"])
    flags = [False] * len(tensors)
    with pytest.raises(ModelParallelError, match=r"on module 'first\.inner' returned a value"):
        replay(_named(caller), structure, tensors, flags, set())
    replay(_named(caller), structure, tensors, flags, {"first.inner"})


def test_backward_hooks_on_a_remote_submodule_are_refused_by_name() -> None:
    model = _Net()

    def on_grad(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        del module, grad_in, grad_out

    model.first.inner.register_full_backward_hook(on_grad)
    with pytest.raises(
        ModelParallelError, match=r"backward hook .*on_grad on module 'first\.inner'"
    ):
        hooked_submodules("first", [("first.inner", model.first.inner)])


def _hooks_on_partition_one() -> dict[str, Any]:
    """``second`` runs on partition 1; rank 0 collects its inner layer's outputs with a hook."""
    dist.init_process_group("gloo")
    init_smp(2, "interleaved", microbatches=2, auto=False)
    module = _Net()
    smp.set_partition(module.second, 1)
    collected: list[Tensor] = []
    if smp.rank() == 0:
        module.second.inner.register_forward_hook(lambda m, a, out: collected.append(out))
    model = smp.DistributedModel(module)
    train = sum_step()

    for _ in range(2):  # the second step would defer its calls without hooks
        train(model, torch.ones(4, 4))
    seen = {"collected": [t.detach() for t in collected]}
    smp.shutdown()
    dist.destroy_process_group()
    return seen


def test_a_hook_on_a_submodule_of_partition_one_fires_on_rank_zero() -> None:
    rank0, rank1 = run_ranks(2, _hooks_on_partition_one, timeout=120)
    assert rank1["collected"] == []
    assert len(rank0["collected"]) == 4, "one call per microbatch and step"
    module = _Net()
    expected = module.second.inner(module.first(torch.ones(2, 4)))
    torch.testing.assert_close(rank0["collected"][0], expected.detach())

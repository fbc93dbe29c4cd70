"""Per-module profile: calls, sizes, tied groups, times that add up, and a model left as found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.modelparallel.plan.profile import (
    ModelProfile,
    Snapshot,
    moved_to,
    profile_module,
    static_profile,
    synchronizer,
)
from tests.modelparallel.models import BranchyNet, GroupedNet, ResidualTransformerLM

BATCH, LENGTH, DIM, VOCAB = 2, 16, 32, 64
HIDDEN_BYTES = BATCH * LENGTH * DIM * 4


@pytest.fixture(scope="module")
def grouped() -> ModelProfile:
    return profile_module(GroupedNet(), (torch.randn(4, 1, 12, 12),))


@pytest.fixture(scope="module")
def lm() -> ModelProfile:
    ids = torch.randint(VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    return profile_module(
        ResidualTransformerLM(),
        (ids,),
        {"labels": ids},
        repeats=1,  # so the times of one pass add up exactly (see test_times_add_up)
        loss_fn=lambda out: out["loss"],
    )


def branchy(sign: float) -> ModelProfile:
    return profile_module(BranchyNet(), (sign * torch.ones(4, 8),))


def test_calls_in_execution_order_with_their_callers(grouped: ModelProfile) -> None:
    assert [(c.module, c.caller) for c in grouped.calls] == [
        ("", -1),
        ("group1", 0),
        ("group1.conv1", 1),
        ("group1.conv2", 1),
        ("group2", 0),
        ("group2.fc1", 4),
        ("group2.fc2", 4),
    ]
    assert [grouped.modules[c.module].order for c in grouped.calls] == list(range(7))
    assert grouped.modules["group1"].children == ["group1.conv1", "group1.conv2"]
    assert grouped.modules["group2.fc1"].parent == "group2"
    assert grouped.root.parent is None


def test_argument_and_output_bytes(grouped: ModelProfile) -> None:
    calls = {c.module: c for c in grouped.calls}
    assert calls[""].input_bytes == 4 * 1 * 12 * 12 * 4
    assert calls["group1"].output_bytes == calls["group2"].input_bytes == 4 * 8 * 4 * 4 * 4
    assert calls[""].output_bytes == calls["group2.fc2"].output_bytes  # passed on as is
    assert calls["group2"].output_bytes == 4 * 10 * 4


@pytest.mark.parametrize(
    ("sign", "taken", "skipped"), [(1.0, "positive", "negative"), (-1.0, "negative", "positive")]
)
def test_data_dependent_branch_and_module_called_twice(
    sign: float, taken: str, skipped: str
) -> None:
    profile = branchy(sign)
    modules = profile.modules
    assert modules[taken].calls == 1
    assert modules[skipped].calls == 0 and modules[skipped].order is None
    assert modules[skipped].forward_time == modules[skipped].backward_time == 0.0
    assert modules["shared"].calls == 2
    first, second = [c.index for c in profile.calls if c.module == "shared"]
    assert first == modules["shared"].order < second
    row = 8 * 4 * 4  # a (4, 8) float tensor
    assert modules["shared"].activation_bytes == 2 * row


def test_kwargs_and_tuple_outputs() -> None:
    profile = branchy(1.0)
    row = 8 * 4 * 4
    pair = next(c for c in profile.calls if c.module == "pair")
    # ``gate=x`` is the model's own input, handed to a later call as a keyword argument.
    assert pair.input_bytes == 2 * row
    assert pair.output_bytes == 2 * row
    root = profile.calls[0]
    assert root.output_bytes == 4 * 2 * 4 + row  # (head output, b)
    # Both outputs were created by children: the root made no activation of its own.
    assert profile.root.activation_bytes == 0
    assert profile.modules["pair"].activation_bytes == 2 * row


def test_tied_group_and_shared_parameter_counted_once(lm: ModelProfile) -> None:
    model = ResidualTransformerLM()
    assert lm.tied_groups == [["wte", "lm_head"]]
    assert lm.modules["wte"].tied_group == lm.modules["lm_head"].tied_group == 0
    assert lm.modules["wpe"].tied_group is None
    assert lm.modules["wte"].param_bytes == VOCAB * DIM * 4
    assert lm.modules["lm_head"].param_bytes == lm.modules["lm_head"].param_count == 0
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(m.param_bytes for m in lm.modules.values()) == unique
    layer_norm = lm.modules["blocks.0.ln1"]
    assert layer_norm.param_count == 2 * DIM


def test_activation_bytes_count_each_tensor_where_it_was_made(lm: ModelProfile) -> None:
    modules = lm.modules
    assert modules["blocks.0.attn.qkv"].activation_bytes == 3 * HIDDEN_BYTES
    # attention returns its projection's output: counted at the projection only
    assert modules["blocks.0.attn"].activation_bytes == 0
    assert modules["blocks.0.attn.proj"].activation_bytes == HIDDEN_BYTES
    assert modules["blocks.0"].activation_bytes == HIDDEN_BYTES  # ``x + mlp(...)`` is new
    assert modules["blocks"].activation_bytes == 0  # a ModuleList never runs


def test_skip_connection_stays_in_the_code_that_made_it(lm: ModelProfile) -> None:
    """The embedding output added after the last block lives in the root's code: no block call
    carries it, so it never crosses between partitions."""
    for call in lm.calls:
        if call.module.count(".") == 1 and call.module.startswith("blocks."):
            assert call.caller == 0
            assert call.input_bytes == call.output_bytes == HIDDEN_BYTES
    ln_f = next(c for c in lm.calls if c.module == "ln_f")
    assert ln_f.input_bytes == HIDDEN_BYTES


def test_times_add_up(lm: ModelProfile) -> None:
    modules = lm.modules.values()
    assert lm.backward_measured and lm.backward_time > 0 and lm.forward_time > 0
    for m in modules:
        assert 0.0 <= m.forward_exclusive <= m.forward_time
        assert 0.0 <= m.backward_exclusive <= m.backward_time + 1e-12
    ran = [m for m in modules if m.calls]
    assert all(m.forward_time > 0 for m in ran)
    # Exclusive times partition the root's inclusive time (one pass: no medians to mix).
    assert sum(m.forward_exclusive for m in modules) == pytest.approx(lm.root.forward_time)
    assert sum(m.backward_exclusive for m in modules) == pytest.approx(lm.root.backward_time)
    assert lm.root.forward_time <= lm.forward_time
    # Parameter updates of ``wte`` (used by ``lm_head`` too) are timed on a module that ran.
    assert lm.modules["wte"].backward_exclusive > 0


def test_model_is_left_as_it_was() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 2))
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    x = torch.randn(5, 6, requires_grad=True)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    rng = torch.get_rng_state()

    profile = profile_module(model, (x,), repeats=2)

    assert profile.modules["1"].buffer_bytes == 2 * 6 * 4 + 8  # running mean, var, count
    assert torch.equal(torch.get_rng_state(), rng)
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    for name, p in model.named_parameters():
        assert p.grad is grads[name] and torch.equal(p.grad, torch.full_like(p, 7.0))
    assert x.grad is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.gpu
def test_a_module_moved_to_the_gpu_for_a_block_is_left_as_found() -> None:
    """Inside the block every parameter and buffer is on the GPU, without gradients (a gradient
    must be on its tensor's device); afterwards the same tensor objects hold their own CPU
    storage again, with their gradients, and a snapshot taken before restores the buffers."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[0].weight.grad = torch.full((3, 3), 7.0)
    tensors = [*model.parameters(), *model.buffers()]
    storage = [t.data_ptr() for t in tensors]
    values = [t.detach().clone() for t in tensors]
    grads = [t.grad for t in tensors]
    snapshot = Snapshot(model, [], cuda=True)
    gpu = torch.device("cuda", 0)
    with moved_to(model, gpu):
        assert all(t.device == gpu and t.grad is None for t in tensors)
        model(torch.randn(4, 3, device=gpu)).sum().backward()  # updates the BatchNorm statistics
    model[1].running_mean.add_(1.0)  # as a trace that needed no move would leave them
    snapshot.restore()
    assert [id(t) for t in [*model.parameters(), *model.buffers()]] == [id(t) for t in tensors]
    assert [t.data_ptr() for t in tensors] == storage
    for tensor, value, grad in zip(tensors, values, grads, strict=True):
        assert tensor.device.type == "cpu" and torch.equal(tensor, value)
        assert tensor.grad is grad


def test_timed_passes_wait_for_the_modules_gpu_not_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    on_gpu1 = [torch.device("cuda", 1), torch.device("cpu"), torch.device("cuda", 1)]
    synchronizer(on_gpu1)()
    synchronizer([torch.device("cpu")])()
    assert synced == [torch.device("cuda", 1)]


def test_every_pass_takes_the_same_random_path() -> None:
    """Each pass starts from the same RNG state: dropout draws the same mask every time, so a
    branch on it goes the same way in the structure pass and the timed ones."""

    class RandomBranch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)
            self.left = nn.Linear(4, 4)
            self.right = nn.Linear(4, 4)
            self.seen: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.drop(x)
            self.seen.append(float(h.sum()))
            return self.left(h) if h.sum() > 0 else self.right(h)

    model = RandomBranch()
    profile = profile_module(model, (torch.randn(3, 4),), repeats=3)
    assert len(model.seen) == 4 and len(set(model.seen)) == 1
    taken, skipped = ("left", "right") if model.seen[0] > 0 else ("right", "left")
    assert profile.modules[taken].forward_time > 0
    assert profile.modules[skipped].forward_time == 0


def test_without_backward() -> None:
    profile = profile_module(GroupedNet(), (torch.randn(2, 1, 12, 12),), backward=False)
    assert not profile.backward_measured and profile.backward_time == 0.0
    assert all(m.backward_time == 0.0 for m in profile.modules.values())


def test_static_profile_knows_the_tree_without_running() -> None:
    profile = static_profile(ResidualTransformerLM())
    assert profile.calls == [] and profile.repeats == 0
    assert profile.tied_groups == [["wte", "lm_head"]]
    assert profile.modules["blocks"].children == [f"blocks.{i}" for i in range(4)]


def test_json_round_trip(lm: ModelProfile) -> None:
    assert ModelProfile.from_json(lm.to_json()) == lm
    data = lm.to_dict()
    data["format"] = 99
    with pytest.raises(ValueError, match="format 99"):
        ModelProfile.from_dict(data)


def test_repeats_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="repeats"):
        profile_module(GroupedNet(), (torch.randn(1, 1, 12, 12),), repeats=-1)


def test_an_untimed_profile_runs_on_the_meta_device_with_exact_counts() -> None:
    """``repeats=0``: the structure pass alone, which runs without memory and counts as the
    timed profile does."""
    timed = profile_module(GroupedNet(), (torch.randn(2, 1, 12, 12),), repeats=1)
    meta = profile_module(
        GroupedNet().to("meta"), (torch.randn(2, 1, 12, 12, device="meta"),), repeats=0
    )
    assert meta.repeats == 0 and meta.backward_measured
    for name, entry in timed.modules.items():
        untimed = meta.modules[name]
        assert (untimed.flops, untimed.activation_bytes) == (entry.flops, entry.activation_bytes)
        assert untimed.forward_time == untimed.backward_time == 0.0


class Counted(nn.Module):
    """Linear layers in a list, one called twice, one in a container, a product in the root."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 8)])
        self.shared = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        x = self.block(self.shared(self.shared(x)))
        return x @ x.T


def test_operations_are_each_modules_own_summed_over_calls() -> None:
    batch = 4
    flops = {
        name: stats.flops
        for name, stats in profile_module(Counted(), (torch.randn(batch, 8),)).modules.items()
    }
    linear = 2 * batch  # multiply-adds per weight entry, for every row of the batch
    assert flops == {
        "": 2 * batch * 8 * batch,  # its own x @ x.T
        "layers": 0,  # a list is never called: its layers' operations are theirs
        "layers.0": linear * 8 * 16,
        "layers.1": linear * 16 * 8,
        "shared": 2 * linear * 8 * 8,  # called twice
        "block": 0,
        "block.0": linear * 8 * 8,
        "block.1": 0,  # torch counts no operations for an activation
    }

"""Tensor parallelism with sharded data parallelism (tp=2 x sdp=2, 4 ranks) trains like one
process on the same global batch: ``smp.nn.DistributedTransformerLMHead`` (two microbatches;
checkpointed after three steps, partial and full, and resumed into fresh models; a full state
dict loads into shards the shard group splits unevenly), a plain model marked with
``smp.set_tensor_parallelism`` (with ``prescaled_batch``; and without, two step calls
accumulating gradients before each ``optimizer.step()``; created differently on each rank, it
starts alike on every rank), Hugging Face GPT-2 created without memory inside
``smp.model_creation(tensor_parallelism=True)`` with its layers' activations checkpointed, and
the LM in bf16 and in fp16 clipped by ``optimizer.clip_master_grads``. All in one world, one
``smp.init`` after the other. Without processes: the mesh of every placement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import dtrain.modelparallel as smp
from dtrain.modelparallel import state
from dtrain.modelparallel.errors import ModelParallelError
from dtrain.modelparallel.state import sharding_grid
from dtrain.modelparallel.tensor.huggingface.gpt2 import translate_state_dict_to_hf_gpt2
from dtrain.topology import Topology
from tests.modelparallel import hf_cases
from tests.modelparallel.api import test_half_precision as half
from tests.modelparallel.harness import run_ranks, single_process
from tests.modelparallel.tensor import test_equivalence as tensor
from tests.modelparallel.tensor import test_gpt2 as gpt2
from tests.modelparallel.tensor.test_mixed import TP_LM
from tests.modelparallel.tensor.test_topology import PLACEMENT_TABLE

SDPTP = {
    "tensor_parallel_degree": 2,
    "sharded_data_parallel_degree": 2,
    "ddp": True,
    "sdp_param_persistence_threshold": 100,  # several units
    "sdp_gradient_clipping": 0.0,  # the references do not clip
}

FP16 = half.Recipe(
    "tp_lm", "fp16", steps=2, microbatches=1, dp=4, pp=1, sdp=2, clip=0.5,
    static_loss_scale=1024.0, clip_master_grads=True,
)  # fmt: skip
HALF = {
    "bf16": half.Recipe("tp_lm", "bf16", steps=2, microbatches=1, dp=4, pp=1, sdp=2),
    "fp16": FP16,
}
"""``test_tensor_mixed``'s LM in half precision, each rank on its own rows (dp 4); fp16 clipped
by ``clip_master_grads`` below every step's norm."""


def _lm_distributing_embedding() -> nn.Module:
    """The LM as AWS's GPT-J script asks for it at sdp and tp above 1: with
    ``distribute_embedding`` (FSDP2 shards its embeddings, as at ``False``)."""
    return smp.nn.DistributedTransformerLMHead(**tensor.LM, distribute_embedding=True)


UNEVEN = {**tensor.LM, "num_attention_heads": 2, "attention_head_size": 3, "hidden_size": 6}
"""An LM whose query, key and value shards (3 rows each at tp 2) the shard group splits
unevenly (2 and 1 rows): FSDP2's ``_StridedShard``, which torch's ``distribute_tensor``
refuses."""


def _uneven() -> nn.Module:
    return smp.nn.DistributedTransformerLMHead(**UNEVEN)


def _doubled() -> dict[str, Tensor]:
    """The whole state of :func:`_uneven`'s LM, doubled: values it does not start with."""
    return {name: value * 2 for name, value in _uneven().state_dict().items()}


def _accumulated() -> dict[str, Tensor]:
    """``test_tensor_equivalence``'s marked MLP, two steps each taking two step calls before
    ``optimizer.step()`` (gradients accumulate over them), on this rank's rows."""
    model, optimizer = tensor._wrapped("mlp", tensor._mlp)
    train_step = tensor.step_of(tensor._mlp_loss)
    rows = tensor.GLOBAL_BATCH // smp.dp_size()
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    for step in range(2):
        optimizer.zero_grad()
        for batch in (2 * step, 2 * step + 1):
            ids, mask = tensor._batch(batch)
            train_step(model, ids[mine], mask[mine])
        optimizer.step()
    return model.state_dict()


def _accumulated_in_one_process() -> dict[str, Tensor]:
    model = tensor._mlp()
    optimizer = tensor._optimizer(model.parameters())
    for step in range(2):
        optimizer.zero_grad()
        for batch in (2 * step, 2 * step + 1):
            tensor._mlp_loss(model, *tensor._batch(batch)).backward()
        optimizer.step()
    return model.state_dict()


def _replicas() -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A plain model created differently on every rank, marked and wrapped: its state as
    created, and the wrapped model's, which every rank must hold alike (each tp group's shards
    of its own, and a replicated bias, taken from the group's first rank; the first replica's
    on the others)."""
    torch.manual_seed(smp.rank())
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    created = {name: value.clone() for name, value in module.state_dict().items()}
    smp.set_tensor_parallelism(module)
    return created, smp.DistributedModel(module).state_dict()


def _half(recipe: half.Recipe) -> dict[str, Any]:
    smp.init({**SDPTP, recipe.dtype: True})
    model = smp.DistributedModel(_lm_distributing_embedding())
    optimizer = smp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=half.LR, momentum=0.9),
        static_loss_scale=recipe.static_loss_scale,
    )

    @smp.step
    def train_step(model: Any, batch: half.Batch) -> Tensor:
        loss = TP_LM.loss(model, batch)
        model.backward(loss)
        return loss

    losses, norms = [], []
    for step in range(recipe.steps):
        batch = half._rows(TP_LM.batch(step), smp.dp_rank(), smp.dp_size())
        optimizer.zero_grad()
        losses.append(float(train_step(model, batch).reduce_mean()))
        if recipe.clip is not None:
            norms.append(optimizer.clip_master_grads(recipe.clip))
        optimizer.step()
    result = {"losses": losses, "norms": norms, "model": model.state_dict()}
    result["dp_rank"] = smp.dp_rank()
    smp.shutdown()
    return result


def _split(model: smp.DistributedModel) -> int:
    """Parameters FSDP2 shards over both the shard group and the tp group."""
    return sum(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in model.parameters())


def _world(folder: str) -> dict[str, Any]:
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    smp.init({**SDPTP, "microbatches": 2})
    st = state.current()
    assert st.sharding_mesh is not None and st.tensor_mesh is not None
    out["meshes"] = (st.sharding_mesh.mesh.tolist(), st.tensor_mesh.mesh.tolist())
    out["lm"] = tensor._train("lm", folder)
    smp.reset()
    model = smp.DistributedModel(_uneven())
    model.load_state_dict(_doubled())
    out["uneven"] = model.state_dict()
    smp.reset()
    out["accumulated"] = _accumulated()
    smp.reset()
    out["replicas"] = _replicas()
    smp.shutdown()
    smp.init({**SDPTP, "prescaled_batch": True, "delayed_parameter_initialization": True})
    out["mlp"] = tensor._train("mlp", None)
    smp.reset()
    with smp.model_creation(tensor_parallelism=True):
        module = hf_cases.build("gpt2")
    assert all(p.is_meta for p in module.parameters())
    model = smp.DistributedModel(module)
    for layer in model.module.transformer.seq_layers:
        smp.set_activation_checkpointing(layer)
    out["gpt2"] = (hf_cases.train_wrapped(model, "gpt2", gpt2.STEPS), model.state_dict())
    out["split"] = _split(model)
    smp.save_checkpoint(folder, "gpt2", partial=False, model=model)
    smp.reset()
    with smp.model_creation(tensor_parallelism=True):
        module = hf_cases.build("gpt2")
    model = smp.DistributedModel(module)
    smp.resume_from_checkpoint(folder, tag="gpt2", partial=False)
    out["gpt2 resumed"] = model.state_dict()
    smp.shutdown()
    for name, recipe in HALF.items():
        out[name] = _half(recipe)
    dist.destroy_process_group()
    return out


def _mean(losses: list[list[float]]) -> list[float]:
    return [sum(rank[step] for rank in losses) / len(losses) for step in range(len(losses[0]))]


def test_tensor_parallel_with_sharded_data_parallel_trains_like_one_process(
    tmp_path: Path,
) -> None:
    ranks = run_ranks(4, _world, str(tmp_path), timeout=240, env=hf_cases.HF_ENV)
    # Shard groups over each tp rank's replicas, tp groups of neighbours (placement cluster).
    assert [r["meshes"] for r in ranks] == [
        ([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])
    ]  # fmt: skip
    for case in ("lm", "mlp"):
        losses, params, saved = tensor.one_process(*tensor.CASES[case])
        assert _mean([r[case][0] for r in ranks]) == pytest.approx(losses, rel=1e-5), case
        for rank in ranks:
            trained = rank[case][1]
            assert trained.keys() == params.keys()
            for key, value in params.items():
                torch.testing.assert_close(trained[key], value, rtol=1e-4, atol=1e-6)
        if case == "lm":  # the full checkpoint, taken after SAVED_AFTER steps
            whole = torch.load(tmp_path / "whole")
            with single_process({}):
                tensor._lm().load_state_dict(whole)  # strict: every key of the plain model
            for key, value in saved.items():
                torch.testing.assert_close(whole[key], value, rtol=1e-4, atol=1e-6)
            files = sorted(p.name for p in (tmp_path / "part_partial").iterdir())
            assert files == [  # one per shard of each tp rank's slice: model_{pp}_{tp}_{rdp}
                f"{kind}_0_{tp}_{rdp}.pt" for kind in ("model", "optimizer")
                for tp in range(2) for rdp in range(2)
            ]  # fmt: skip
    with single_process({}):
        doubled = _doubled()
    for rank in ranks:  # a full state dict loaded into unevenly split shards
        assert rank["uneven"].keys() == doubled.keys()
        assert all(torch.equal(v, rank["uneven"][k]) for k, v in doubled.items())
    created = [rank["replicas"][0] for rank in ranks]
    assert not any(torch.equal(created[0][k], created[r][k]) for k in created[0] for r in (1, 2))
    for rank in ranks:  # every rank starts alike
        wrapped = rank["replicas"][1]
        assert all(torch.equal(v, ranks[0]["replicas"][1][k]) for k, v in wrapped.items())
    with single_process({}):
        params = _accumulated_in_one_process()
    for rank in ranks:  # each step call's gradients averaged once, then added
        for key, value in params.items():
            torch.testing.assert_close(rank["accumulated"][key], value, rtol=1e-4, atol=1e-6)
    losses, params = gpt2._plain()
    for rank in ranks:  # its full checkpoint loaded into a fresh model
        resumed = rank["gpt2 resumed"]
        assert resumed.keys() == rank["gpt2"][1].keys()
        assert all(torch.equal(v, rank["gpt2"][1][k]) for k, v in resumed.items())
    assert {r["split"] for r in ranks} == {12 * 4}  # every tensor of its 4 layers but norms
    assert _mean([r["gpt2"][0] for r in ranks]) == pytest.approx(losses, rel=1e-5)
    for rank in ranks:
        back = translate_state_dict_to_hf_gpt2(rank["gpt2"][1])
        for key, value in params.items():
            torch.testing.assert_close(back[key], value, rtol=1e-4, atol=1e-6, msg=key)
    for name, recipe in HALF.items():
        with single_process({}):
            expected = half.reference(recipe, TP_LM)
        eps = torch.finfo(half.DTYPES[name]).eps
        for got in (rank[name] for rank in ranks):
            want = [step[got["dp_rank"]] for step in expected["losses"]]
            assert got["losses"] == pytest.approx(want, rel=8 * eps), name
            assert got["norms"] == pytest.approx(expected["norms"], rel=1e-2), name
            for key, value in expected["masters"].items():
                master = got["model"][key]
                assert master.dtype == torch.float32, key
                torch.testing.assert_close(
                    master, value, rtol=0, atol=half.TOLERANCE[name], msg=key
                )


# --- the mesh's layout, without processes ---------------------------------------------------

TP_RIGHT = {"DPT", "DTP", "PDT", "cluster"}
"""Placements whose tp groups are neighbouring ranks (T right of D; P is 1 with sharding)."""


@pytest.mark.parametrize("placement", sorted(PLACEMENT_TABLE))
def test_sharding_grid_at_tp2_sdp2_follows_the_placement(placement: str) -> None:
    """World 4: shard groups of each tp rank's 2 replicas, no replicate dimension; world 8
    (rdp 4): the replicas of a tp rank in 2 shard groups, replicating each other (HSDP)."""
    right = placement in TP_RIGHT
    four = Topology(4, 4, tensor_degree=2, placement=placement)
    grid, kinds = sharding_grid(four, 2)
    assert kinds == ("shard", "tp")
    assert grid.tolist() == ([[0, 1], [2, 3]] if right else [[0, 2], [1, 3]])
    eight = Topology(8, 8, tensor_degree=2, placement=placement)
    grid, kinds = sharding_grid(eight, 2)
    assert kinds == ("replicate", "shard", "tp")
    if right:
        assert grid.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    else:
        assert grid.tolist() == [[[0, 4], [1, 5]], [[2, 6], [3, 7]]]
    for topology in (four, eight):
        ranks = sharding_grid(topology, 2)[0]
        for row in ranks.reshape(-1, 2).tolist():  # the rows: tp groups
            assert topology.tp_group(row[0]) == row
        for tp in range(2):  # the rest: one tp rank's replicas
            replicas = sorted(ranks[..., tp].reshape(-1).tolist())
            assert topology.rdp_group(replicas[0]) == replicas


def test_sharding_grid_without_tensor_parallelism_is_the_data_parallel_one() -> None:
    grid, kinds = sharding_grid(Topology(4, 4), 2)
    assert (grid.tolist(), kinds) == ([[0, 1], [2, 3]], ("replicate", "shard"))
    grid, kinds = sharding_grid(Topology(4, 4), 4)
    assert (grid.tolist(), kinds) == ([0, 1, 2, 3], ("shard",))


def test_distribute_embedding_needs_sharded_data_parallelism() -> None:
    with single_process({}), pytest.raises(ModelParallelError) as refused:
        _lm_distributing_embedding()
    assert str(refused.value) == (
        "smp.nn.DistributedTransformerLMHead: distribute_embedding=True is supported by dtrain "
        "only with sharded_data_parallel_degree above 1 (there FSDP2 shards the embeddings and "
        "head over the shard group; dtrain never splits them over the tp group); allowed: False"
    )

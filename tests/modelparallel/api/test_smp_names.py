"""SMP v1 names AWS's scripts (and Hugging Face's ``Trainer``) read, served or refused by name,
in a world of one (no processes): ``smp.state.cfg``, ``smp.state.module_manager``,
``state_mod.state``, ``smp.model.DistributedModel``, ``smp.utils``, ``smp.optimizers``,
``smp.sharded_data_parallel_checkpoint``, DeepSpeed's names for the shards. The sharded path
itself, with its DTensor shards, is :mod:`tests.modelparallel.api.test_sharded_scripts`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

import dtrain.modelparallel as smp
from dtrain.compat import SHIM_ROOT
from dtrain.errors import DtrainError
from dtrain.modelparallel.api import deepspeed_names
from dtrain.modelparallel.api.model import DistributedModel
from dtrain.modelparallel.api.sharded_checkpoint import (
    get_full_state_dict_from_sharded_data_parallel_checkpoint,
)
from dtrain.modelparallel.api.smp_state import smp_state
from dtrain.modelparallel.errors import NotInitializedError
from dtrain.modelparallel.optimizers import FusedLAMB
from tests.modelparallel import hf_cases
from tests.modelparallel.harness import single_process


@pytest.fixture
def shim(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``smdistributed.modelparallel.torch`` as scripts import it (outside a job: no start)."""
    monkeypatch.syspath_prepend(str(SHIM_ROOT))
    for name in [m for m in sys.modules if m.split(".")[0] == "smdistributed"]:
        monkeypatch.delitem(sys.modules, name)
    try:
        yield importlib.import_module("smdistributed.modelparallel.torch")
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "smdistributed"]:
            del sys.modules[name]


def test_state_cfg_holds_the_running_parameters_read_only() -> None:
    with pytest.raises(NotInitializedError, match=r"smp\.state\.cfg"):
        _ = smp_state.cfg
    with single_process({"prescaled_batch": True, "fp16": True, "microbatches": 2}):
        cfg = smp_state.cfg
        assert cfg.fp16 is True and cfg.bf16 is False and cfg.prescaled_batch is True
        assert cfg.shard_optimizer_state is False and cfg.sharded_data_parallel_degree == 1
        assert cfg.microbatches == 2 and cfg.pipeline_parallel_degree == 1
        assert "tensor_parallel_degree" in dir(cfg)
        with pytest.raises(AttributeError, match="did you mean 'microbatches'"):
            _ = cfg.microbatch
        with pytest.raises(AttributeError, match=r"internal parameters.*accepts and ignores"):
            _ = cfg.static_mode
        with pytest.raises(AttributeError, match="read-only"):
            cfg.fp16 = False
        assert not hasattr(cfg, "__wrapped__")


def test_the_state_object_refuses_what_dtrain_does_not_keep_by_name() -> None:
    with pytest.raises(AttributeError, match="param_name_to_index_tp_group: SMP's optimizer"):
        _ = smp_state.param_name_to_index_tp_group
    with pytest.raises(AttributeError, match=r"serves cfg .* and module_manager"):
        _ = smp_state.exec_server
    with pytest.raises(AttributeError, match=r"module_manager\.reset: .* serves translate"):
        _ = smp_state.module_manager.reset


def test_module_manager_translates_the_model_to_hugging_face_names() -> None:
    with single_process({}):
        assert smp_state.module_manager.translate_functions == []  # no model yet
        with smp.tensor_parallelism():
            module = hf_cases.build("gpt2")
        model = smp.DistributedModel(module)  # becomes DistributedTransformerLMHead
        assert type(model.get_module()).__name__ == "DistributedTransformerLMHead"
        [(to_hf, from_hf)] = smp_state.module_manager.translate_functions
        mine = model.state_dict()
        theirs = to_hf(mine)
        assert theirs.keys() == hf_cases.build("gpt2").state_dict().keys() != mine.keys()
        assert from_hf(theirs).keys() == mine.keys()


def test_scripts_import_paths_give_dtrains_names(shim: ModuleType) -> None:
    state_mod = importlib.import_module("smdistributed.modelparallel.torch.state_mod")
    assert shim.state is state_mod.state is smp_state
    assert shim.model.DistributedModel is DistributedModel  # Hugging Face's Trainer checks it
    optimizers = importlib.import_module("smdistributed.modelparallel.torch.optimizers")
    assert optimizers.FusedLAMB is shim.optimizers.FusedLAMB is FusedLAMB
    checkpoints = importlib.import_module(
        "smdistributed.modelparallel.torch.sharded_data_parallel_checkpoint"
    )
    whole = get_full_state_dict_from_sharded_data_parallel_checkpoint
    assert checkpoints.get_full_state_dict_from_sharded_data_parallel_checkpoint is whole
    assert shim.sharded_data_parallel_checkpoint.__dict__[whole.__name__] is whole
    utils = importlib.import_module("smdistributed.modelparallel.torch.utils")
    assert shim.utils is utils
    with pytest.raises(AttributeError, match="hvd_average_grads: not served: Horovod"):
        _ = shim.hvd_average_grads
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = shim.no_such_name
    with single_process({}):
        assert utils.rmsg("loaded") == "[0] loaded"
        assert utils.get_distribution_axis(torch.nn.Parameter(torch.ones(2))) is None


def _group(*sizes: int) -> dict[str, list[torch.nn.Parameter]]:
    return {"params": [torch.nn.Parameter(torch.arange(float(n))) for n in sizes]}


def test_flat_groups_serve_each_parameters_shard_as_a_view_and_nothing_across() -> None:
    """A parameter without sharding is its own shard: the narrowing works alike."""
    group = _group(3, 0, 2)
    deepspeed_names.mark_shards(group["params"])
    first, empty, last = group["params"]
    assert [p.ds_tensor.ds_numel for p in group["params"]] == [3, 0, 2]  # type: ignore[attr-defined]
    flat = deepspeed_names.FlatGroup(group, 0)
    view = flat.narrow(0, 3, 2)  # the last parameter, laid after the first (and the empty one)
    assert torch.equal(view, last.detach())
    with torch.no_grad():
        last.add_(1.0)  # training moves the parameter: the view sees it
    assert torch.equal(view, torch.tensor([1.0, 2.0]))
    assert flat.narrow(0, 1, 2).tolist() == [1.0, 2.0]  # within one parameter
    assert flat.narrow(0, 5, 0).numel() == 0  # an empty shard at the group's end
    with pytest.raises(DtrainError, match=r"narrow\(0, 2, 2\).*within one parameter's shard"):
        flat.narrow(0, 2, 2)  # across two parameters: no one tensor holds it
    with pytest.raises(AttributeError, match=r"fp32_partitioned_groups_flat\[0\]\.numel"):
        flat.numel()
    assert torch.equal(first.ds_tensor, first.detach().view(-1))  # type: ignore[attr-defined]
    assert empty.ds_tensor.numel() == 0  # type: ignore[attr-defined]


def test_a_checkpoint_not_saved_by_a_sharded_model_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no partial model files"):
        get_full_state_dict_from_sharded_data_parallel_checkpoint(tmp_path, tag="none")
    with single_process({}):
        model = smp.DistributedModel(torch.nn.Linear(2, 2))
        smp.save_checkpoint(tmp_path, "pipelined", model=model)
    with pytest.raises(DtrainError, match="not saved by a sharded model"):
        get_full_state_dict_from_sharded_data_parallel_checkpoint(tmp_path)  # the newest

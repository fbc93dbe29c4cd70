"""``import torch.sagemaker``: every name AWS's SMP v2 scripts import exists; what dtrain serves
works, what it does not yet fails naming itself; the package comes from torch's extension
autoloading, in any fresh interpreter, without shadowing a real one."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.smpv2.unavailable import NotAvailableYet, Unavailable

# What amazon-sagemaker-examples' sm-distributed_model_parallel_v2/shared-scripts import from
# torch.sagemaker (train_lib.py, train_utils.py, checkpoints.py, fsdp_utils.py), and AWS's
# reference adds: served by dtrain ...
SERVED = {
    "torch.sagemaker": ["init", "is_initialized", "state", "transform"],
    "torch.sagemaker.delayed_param": ["DelayedParamIniter"],
    "torch.sagemaker.tensor_parallel.transformer": ["TransformerLayer"],
    "torch.sagemaker.logger": ["get_logger"],
    "torch.sagemaker.utils.utils": ["timeit"],
    "torch.sagemaker.utils.process_group_utils": ["get_global_ranks"],
    "torch.sagemaker.grad_norm": ["clip_grad_norm_"],
    "torch.sagemaker.checkpoint.utils": ["SORT_BY_LAST_INT", "limit_num_subdirs"],
    "torch.sagemaker.distributed.checkpoint.state_dict_saver": [
        "save", "async_save", "maybe_finalize_async_calls",
    ],
    "torch.sagemaker.distributed.checkpoint.state_dict_loader": ["load"],
    "torch.sagemaker.distributed.checkpoint.filesystem": [
        "DistributedFileSystemReader", "DistributedFileSystemWriter",
    ],
    "torch.sagemaker.distributed.checkpoint.state_dict_utils": [
        "sm_state_dict_type", "SMStateDictType", "init_optim_state",
    ],
    "torch.sagemaker.distributed.checkpoint.async_utils": ["AsyncCallsQueue"],
}  # fmt: skip
# ... and not yet: each fails naming itself when used.
NOT_YET = {
    "torch.sagemaker.distributed.checkpoint.state_dict_saver": ["PyTorchDistSaveShardedStrategy"],
    "torch.sagemaker.moe.moe_config": ["MoEConfig"],
    "torch.sagemaker.moe.moe_layer": ["MoELayer"],
    "torch.sagemaker.nn.attn": ["FlashSelfAttention", "FlashGroupedQueryAttention"],
    "torch.sagemaker.nn.huggingface.llama_flashattn": ["LlamaFlashAttention"],
    "torch.sagemaker.tensor_parallel.transformer": ["TETransformerLayer"],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(SERVED))
def test_served_names(module: str) -> None:
    imported = importlib.import_module(module)
    for name in SERVED[module]:
        assert not isinstance(getattr(imported, name), Unavailable), f"{module}.{name}"


@pytest.mark.parametrize("module", sorted(NOT_YET))
def test_names_not_built_yet_fail_naming_themselves(module: str) -> None:
    imported = importlib.import_module(module)
    for name in NOT_YET[module]:
        stand_in = getattr(imported, name)
        with pytest.raises(NotAvailableYet, match=rf"^{module}\.{name}: not available yet"):
            stand_in()
        with pytest.raises(NotAvailableYet, match=rf"^{module}\.{name}: not available yet"):
            _ = stand_in.SM_LOCAL_STATE_DICT  # an enum's member, a class attribute
        assert not hasattr(stand_in, "__wrapped__")  # probes see an ordinary missing attribute


def fresh_python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, **env},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_fresh_interpreter_imports_it_first_and_never_shadows_a_real_one(
    tmp_path: Path,
) -> None:
    first = fresh_python("import torch.sagemaker as tsm; print(type(tsm.state).__name__)", tmp_path)
    assert first.returncode == 0 and first.stdout.strip() == "State", first.stderr
    real = tmp_path / "elsewhere" / "sagemaker"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    code = f"import torch; torch.__path__.append({str(real.parent)!r}); import torch.sagemaker"
    shadowed = fresh_python(f"{code} as tsm; print(tsm.REAL)", tmp_path)
    assert shadowed.returncode == 0 and shadowed.stdout.strip() == "True", shadowed.stderr


def test_without_torchs_autoloading_only_the_rank_runner_gives_it(tmp_path: Path) -> None:
    """As where dtrain runs from its source tree, which declares no entry point for torch."""
    off = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    plain = fresh_python("import torch.sagemaker", tmp_path, **off)
    assert plain.returncode == 1 and "No module named 'torch.sagemaker'" in plain.stderr
    (tmp_path / "train.py").write_text(
        "import torch.sagemaker as tsm\nprint(tsm.is_initialized())\n"
    )
    runner = subprocess.run(
        [sys.executable, "-m", "dtrain.launch.entry", "train.py"], cwd=tmp_path,
        env={**os.environ, **off}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert runner.returncode == 0 and runner.stdout.strip() == "False", runner.stderr


FSDP_NAMES = """
import torch.distributed.fsdp as fsdp
before = (fsdp.FullyShardedDataParallel, fsdp.fully_shard)
print(before[0].__module__, "dtrain" in before[1].__code__.co_filename)
import torch.sagemaker
from torch.distributed._composable.fsdp import fully_shard as older_home
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
mine = fully_shard.__code__.co_filename.endswith("smpv2/fsdp.py")
print(FullyShardedDataParallel.__module__, mine)
print(issubclass(FullyShardedDataParallel, before[0]), fully_shard.__wrapped__ is before[1])
print(older_home is fully_shard, fully_shard.state is before[1].state)
"""


def test_torchs_fsdp_names_are_smps_where_torch_sagemaker_is_imported(tmp_path: Path) -> None:
    """An interpreter that has not imported torch.sagemaker has torch's own FSDP; importing it
    rebinds torch.distributed.fsdp's names (and FSDP2's older home) to dtrain's, in memory."""
    names = fresh_python(FSDP_NAMES, tmp_path)
    assert names.returncode == 0, names.stderr
    before, after, *checks = names.stdout.split("\n")[:4]
    assert before == "torch.distributed.fsdp.fully_sharded_data_parallel False"
    assert after == "dtrain.smpv2.fsdp True"  # fully_shard: dtrain's wrapper, in dtrain's file
    assert checks == ["True True", "True True"]

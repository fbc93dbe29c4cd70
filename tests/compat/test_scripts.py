"""Scripts written for SageMaker's smdistributed libraries run unmodified under dtrain run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dtrain.compat import SHIM_ROOT, real_smdistributed_installed, shim_pythonpath_entry
from tests.conftest import JOB_SCRIPTS, dtrain

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("script", "layout", "expected"),
    [
        ("smddp_v1.py", ["--instance-count", "2"], "smddp v1 ok"),
        ("smddp_backend.py", ["--processes-per-host", "2"], "smddp backend ok"),
    ],
)
def test_smddp_scripts_run_unmodified(
    dtrain_home: Path, script: str, layout: list[str], expected: str
) -> None:
    distribution = '{"smdistributed": {"dataparallel": {"enabled": true}}}'
    result = dtrain(
        "run", script, "--source-dir", str(JOB_SCRIPTS), "--instance-type", "local_cpu",
        "--distribution", distribution, *layout, home=dtrain_home,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(expected) == 2  # two ranks: on two hosts, or on one


def test_shim_is_used_only_without_a_real_installation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not real_smdistributed_installed()
    assert shim_pythonpath_entry() == str(SHIM_ROOT)
    real = tmp_path / "site" / "smdistributed"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "smdistributed", raising=False)
    assert real_smdistributed_installed()
    assert shim_pythonpath_entry() is None


SMP_SCRIPT = """
import smdistributed.modelparallel
import smdistributed.modelparallel.torch as smp

assert smdistributed.modelparallel.__version__ >= "1.10"  # what Hugging Face transformers reads
import warnings

from smdistributed.modelparallel.torch.patches.checkpoint import (  # SMP's activation checkpointing
    checkpoint,
    checkpoint_sequential,
    set_activation_checkpointing,
)

assert smp.set_activation_checkpointing is set_activation_checkpointing
assert callable(checkpoint) and callable(checkpoint_sequential)

from dtrain.modelparallel import state

with warnings.catch_warnings(record=True) as caught:  # AWS's GPT-NeoX script passes defaults
    warnings.simplefilter("always")
    smp.init({"microbatches": 99, "pipeline": "simple", "static_mode": True})
assert smp.is_initialized() and smp.num_microbatches() == 4  # the job's value wins
assert sorted(str(w.message).split(" is ")[0] for w in caught) == [
    "mp_parameters.static_mode", "smp.init: mp_parameters.microbatches"
], [str(w.message) for w in caught]
assert state.current().config["pipeline"] == "simple"
assert smp.allgather(smp.rank(), smp.WORLD) == list(range(smp.size()))
if smp.pp_rank() == 0:
    smp.broadcast(f"from {smp.rank()}", smp.PP_GROUP)
else:
    assert smp.recv_from(0, smp.RankType.PP_RANK) == f"from {smp.get_pp_group()[0]}"
smp.barrier()
print(f"smp v1 ok rank={smp.rank()} local_rank={smp.local_rank()} pp_rank={smp.pp_rank()} "
      f"dp_rank={smp.dp_rank()} mp_group={smp.get_mp_group()}", flush=True)
"""


def test_smp_script_runs_unmodified_and_initializes_on_import(
    dtrain_home: Path, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "smp_v1.py").write_text(SMP_SCRIPT)
    distribution = (
        '{"mpi": {"enabled": true}, "smdistributed": {"modelparallel": {"enabled": true, '
        '"parameters": {"partitions": 2, "microbatches": 4, "ddp": true}}}}'
    )
    result = dtrain(
        "run", "smp_v1.py", "--source-dir", str(source), "--instance-type", "local_cpu",
        "--distribution", distribution, "--instance-count", "2", "--processes-per-host", "2",
        home=dtrain_home,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    for rank, mp_group in enumerate(([0, 1], [0, 1], [2, 3], [2, 3])):
        expected = (
            f"smp v1 ok rank={rank} local_rank={rank % 2} pp_rank={rank % 2} "
            f"dp_rank={rank // 2} mp_group={mp_group}"
        )
        assert expected in result.stdout


def test_smp_manual_init_defers_initialization(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"partitions": 1}')
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("SMP_MANUAL_INIT", "1")
    monkeypatch.syspath_prepend(str(SHIM_ROOT))
    for name in [m for m in sys.modules if m.split(".")[0] == "smdistributed"]:
        monkeypatch.delitem(sys.modules, name)
    try:
        import smdistributed.modelparallel.torch as smp

        import dtrain.modelparallel

        assert smp.init is dtrain.modelparallel.init and smp.DistributedModel is not None
        assert set(smp.__all__) >= {"init", "step", "DistributedModel", "save_checkpoint", "amp"}
        assert not smp.is_initialized()
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "smdistributed"]:
            del sys.modules[name]

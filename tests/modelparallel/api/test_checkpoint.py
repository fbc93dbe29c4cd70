"""smp.save/load and save_checkpoint/resume_from_checkpoint with SMP's file layout.

The model and optimizer are small fakes following the protocol checkpoint.py codes against:
pp rank 0 holds parameter ``a``, pp rank 1 holds ``b``; every rank starts from its own values, so
what a rank loads shows whose file it read.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dtrain.modelparallel as smp
from dtrain.modelparallel import state
from dtrain.modelparallel.api.checkpoint import OPTIMIZER_SHARDS_KEY
from dtrain.modelparallel.api.state_dicts import DEGREES_KEY
from dtrain.modelparallel.errors import ModelParallelError, NotInitializedError
from tests.modelparallel.harness import run_ranks, single_process

PARTIAL = "_smp_is_partial"


class FakeModel:
    def __init__(self, value: float) -> None:
        self.params = {"a": torch.full((2,), value), "b": torch.full((3,), value)}
        self.loads: list[tuple[str, bool]] = []

    def _mine(self) -> str:
        return "ab"[smp.pp_rank()]

    def local_state_dict(self) -> dict[str, Any]:
        return {self._mine(): self.params[self._mine()].clone(), PARTIAL: True}

    def state_dict(self) -> dict[str, Any]:
        parts = smp.allgather({self._mine(): self.params[self._mine()]}, smp.PP_GROUP)
        return {k: v for part in parts for k, v in part.items()}

    def load_state_dict(self, sd: dict[str, Any], strict: bool = True) -> None:
        self.loads.append(("partial" if sd.get(PARTIAL) else "full", strict))
        self.params.update({k: v for k, v in sd.items() if k != PARTIAL})


class FakeOptimizer:
    def __init__(self, step: int) -> None:
        self.step = step

    def local_state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "pp": smp.pp_rank(), PARTIAL: True}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _checkpoints(path: str) -> dict[str, Any]:
    root = Path(path)
    smp.init({"pipeline_parallel_degree": 2, "ddp": True})  # cluster: dp rank 0 = ranks 0, 1
    me = smp.rank()
    model, optimizer = FakeModel(float(me)), FakeOptimizer(100 + me)
    state.register_model(model)
    state.register_optimizer(optimizer)
    out: dict[str, Any] = {}

    smp.save_checkpoint(root, "step1", model=model, optimizer=optimizer, user_content={"e": 1})
    out["after_step1"] = _files(root)
    model.params = {k: torch.zeros_like(v) for k, v in model.params.items()}
    out["user_content"] = smp.resume_from_checkpoint(root)
    out["resumed"] = {k: v.tolist() for k, v in model.params.items()}
    out["optimizer_step"] = optimizer.step
    # As if the second stage's optimizer state were split otherwise, then with no model file
    # for it either: every rank fails, none waits for the others.
    for key, name in (("missing", "optimizer"), ("no_model", "model")):
        smp.barrier()  # every rank has read its files
        if me == 0:
            (root / "step1_partial" / f"{name}_1_0_0.pt").unlink()
        smp.barrier()
        try:
            smp.resume_from_checkpoint(root, "step1")
        except (ModelParallelError, FileNotFoundError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    for tag in ("step2", "step3"):
        smp.save_checkpoint(root, tag, model=model, num_kept_partial_checkpoints=2)
    out["after_pruning"] = sorted(p.name for p in root.iterdir())

    model.params = {"a": torch.full((2,), 7.0), "b": torch.full((3,), 8.0)}
    smp.save_checkpoint(root, "final", partial=False, model=model, user_content="done")
    out["full_file"] = {k: v.tolist() for k, v in torch.load(root / "final").items()}
    out["full_user_content"] = smp.resume_from_checkpoint(root, partial=False, strict=False)
    out["loads"] = model.loads
    out["newest"] = (root / "newest").read_text()

    if smp.dp_rank() == 0:
        smp.save({"pp": smp.pp_rank()}, root / "extra")
    smp.save({"rank": me}, root / "whole", partial=False)
    smp.barrier()
    out["extra"] = smp.load(root / "extra")
    out["whole"] = smp.load(root / "whole", partial=False)
    try:
        smp.save_checkpoint(root, f"tag{me % 2}", model=model)
    except ModelParallelError as exc:
        out["tag_error"] = str(exc)
    return out


def test_partial_and_full_checkpoints_round_trip_on_a_pipeline(tmp_path: Path) -> None:
    results = run_ranks(4, _checkpoints, str(tmp_path))
    first = results[0]
    assert first["after_step1"] == [
        "newest",
        "step1_partial/model_0_0_0.pt",
        "step1_partial/model_1_0_0.pt",
        "step1_partial/optimizer_0_0_0.pt",
        "step1_partial/optimizer_1_0_0.pt",
        "step1_partial/user_content.pt",
    ]
    for rank, out in enumerate(results):
        pp = rank % 2
        assert out["user_content"] == {"e": 1}
        # each rank loads its own partition's part, as written by the partition's dp rank 0
        resumed = {"a": [0.0, 0.0], "b": [1.0, 1.0, 1.0]}
        assert out["resumed"]["ab"[pp]] == resumed["ab"[pp]]
        assert out["resumed"]["ba"[pp]] == [0.0] * len(resumed["ba"[pp]])  # untouched
        assert out["optimizer_step"] == 100 + pp
        assert out["missing"] == (
            f"ModelParallelError: smp.resume_from_checkpoint({tmp_path / 'step1_partial'}): "
            "ranks [1, 3] find no optimizer state of theirs (each reads "
            "optimizer_{pp_rank}_{tp_rank}_{rdp_rank}.pt), the other ranks do: it was saved split "
            "otherwise (this job holds it whole); resume with the shard_optimizer_state and rdp "
            "degree it was saved with, or with load_optimizer=False to start the optimizer afresh"
        )
        assert out["no_model"] == (
            f"FileNotFoundError: smp.resume_from_checkpoint({tmp_path / 'step1_partial'}): "
            "ranks [1, 3] find no model file of theirs (model_1_0_0.pt does not exist; not a "
            "partial checkpoint?)"
        )
        assert out["after_pruning"] == ["newest", "step2_partial", "step3_partial"]
        assert out["full_file"] == {"a": [7.0, 7.0], "b": [8.0, 8.0, 8.0]}
        assert out["full_user_content"] == "done"
        assert out["loads"] == [("partial", True), ("full", False)]
        assert out["newest"] == "final"
        assert out["extra"] == {"pp": pp} and out["whole"] == {"rank": 0}
        assert out["tag_error"] == "every rank must save the same checkpoint tag, got " + str(
            ["tag0", "tag1", "tag0", "tag1"]
        )
    assert not (tmp_path / "whole_0_0.pt").exists()
    assert (tmp_path / "extra_0_0.pt").exists() and (tmp_path / "extra_1_0.pt").exists()


def test_wrong_uses_are_explained(tmp_path: Path) -> None:
    with pytest.raises(NotInitializedError, match=r"smp\.save_checkpoint"):
        smp.save_checkpoint(tmp_path, "t")
    with single_process():
        with pytest.raises(ModelParallelError, match=r"create smp\.DistributedModel first"):
            smp.resume_from_checkpoint(tmp_path)
        state.register_model(FakeModel(0.0))
        with pytest.raises(FileNotFoundError, match="newest does not exist; pass tag="):
            smp.resume_from_checkpoint(tmp_path)
        with pytest.raises(ValueError, match="tag must be a non-empty string"):
            smp.save_checkpoint(tmp_path, "a/b")
        for tag in ("..", "a\nb"):
            with pytest.raises(ValueError, match="without '/' or control characters"):
                smp.save_checkpoint(tmp_path, tag)
        with pytest.raises(ValueError, match=r"checkpoint tag must .* got '\.\./x'"):
            smp.resume_from_checkpoint(tmp_path, tag="../x")
        (tmp_path / "newest").write_text("../x\n")
        with pytest.raises(ValueError, match=r"the tag in .*newest must be a non-empty string"):
            smp.resume_from_checkpoint(tmp_path)
        with pytest.raises(ValueError, match="num_kept_partial_checkpoints must be at least 1"):
            smp.save_checkpoint(tmp_path, "t", num_kept_partial_checkpoints=0)
        torch.save({}, tmp_path / "m.pt_0_0.pt")
        torch.save({}, tmp_path / "m.pt_1_0.pt")  # saved by a 2-stage pipeline
        with pytest.raises(ModelParallelError, match=r"found 2 partial files .* 1 model-parallel"):
            smp.load(tmp_path / "m.pt")


class Planted:
    """What a hostile checkpoint holds: unpickling it runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


class Step:
    """An object of the script's own class in its user_content."""

    def __init__(self, step: int) -> None:
        self.step = step


def test_loading_never_runs_code_from_a_planted_file_unless_trusted(tmp_path: Path) -> None:
    ran = tmp_path / "code-ran"
    with single_process():
        model = FakeModel(0.0)
        state.register_model(model)
        smp.save_checkpoint(tmp_path / "ckpt", "t", model=model, user_content={"step": 3})
        planted = tmp_path / "ckpt" / "t_partial" / "model_0_0_0.pt"
        torch.save({"a": Planted(ran)}, planted)
        with pytest.raises(Exception, match="Weights only load failed"):
            smp.resume_from_checkpoint(tmp_path / "ckpt")
        torch.save(Planted(ran), tmp_path / "m.pt_0_0.pt")
        with pytest.raises(Exception, match="Weights only load failed"):
            smp.load(tmp_path / "m.pt")
        assert not ran.exists()

        smp.save_checkpoint(tmp_path / "own", "t", model=model, user_content=Step(7))
        with pytest.raises(Exception, match="Weights only load failed"):
            smp.resume_from_checkpoint(tmp_path / "own")
        assert smp.resume_from_checkpoint(tmp_path / "own", weights_only=False).step == 7


def test_saving_a_tag_again_clears_what_an_earlier_save_at_other_degrees_left(
    tmp_path: Path,
) -> None:
    # A save of tag t at tp=2 left model_0_1_0.pt; saved again at tp=1, t resumes at tp=1.
    with single_process():
        model = FakeModel(1.0)
        state.register_model(model)
        stale = tmp_path / "t_partial" / "model_0_1_0.pt"
        stale.parent.mkdir()
        torch.save({"a": torch.zeros(2), PARTIAL: True}, stale)
        smp.save_checkpoint(tmp_path, "t", model=model)
        assert _files(tmp_path) == ["newest", "t_partial/model_0_0_0.pt"]
        smp.resume_from_checkpoint(tmp_path, tag="t")
        assert model.loads == [("partial", True)]


def test_optimizer_state_split_otherwise_is_refused_and_an_older_file_loads(
    tmp_path: Path,
) -> None:
    # Saved in 2 shards (shard_optimizer_state at rdp 2), resumed where each rank holds it whole.
    with single_process():
        state.register_model(FakeModel(1.0))
        optimizer = FakeOptimizer(5)
        state.register_optimizer(optimizer)
        smp.save_checkpoint(tmp_path, "t", model=state.current_model(), optimizer=optimizer)
        file = tmp_path / "t_partial" / "optimizer_0_0_0.pt"
        saved = torch.load(file)
        assert saved.pop(OPTIMIZER_SHARDS_KEY) == 1
        torch.save({**saved, OPTIMIZER_SHARDS_KEY: 2}, file)
        with pytest.raises(ModelParallelError) as caught:
            smp.resume_from_checkpoint(tmp_path, tag="t")
        assert str(caught.value) == (
            f"smp.resume_from_checkpoint({tmp_path / 't_partial'}): the optimizer state of rank "
            "0 was saved in 2 shards, this job holds it whole (shard_optimizer_state False, rdp "
            "degree 1); allowed: the same split; resume with the shard_optimizer_state and rdp "
            "degree it was saved with, or with load_optimizer=False to start the optimizer afresh"
        )
        torch.save({**saved, "step": 6}, file)  # as dtrain saved it before recording the split
        smp.resume_from_checkpoint(tmp_path, tag="t")
        assert optimizer.step == 6


class SavedAtPp2(FakeModel):
    """A fake whose partial state names degrees pp 2 x tp 1 (as a pp=2 job's would)."""

    def local_state_dict(self) -> dict[str, Any]:
        degrees = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 1}
        return {**super().local_state_dict(), DEGREES_KEY: degrees}


def test_resuming_reads_the_saved_degrees_from_the_model_file_not_the_file_names(
    tmp_path: Path,
) -> None:
    # The folder holds model_0_0_0.pt only (on a node's own disk, rank 0's), as a pp=1 save.
    with single_process():
        model = SavedAtPp2(1.0)
        state.register_model(model)
        smp.save_checkpoint(tmp_path, "t", model=model)
        with pytest.raises(ModelParallelError, match="the partial state was saved at pipeline"):
            smp.resume_from_checkpoint(tmp_path, tag="t")
        assert model.loads == []


def test_user_content_with_numpy_values_loads_as_weights_only(tmp_path: Path) -> None:
    """AWS's GPT-2 script saves numpy scalars and its GPT2Config in user_content; an object
    array and other classes stay refused."""
    from transformers import GPT2Config

    content = {
        "num_params": np.int64(167680),
        "loss": np.float32(6.4),
        "seen": np.arange(3.0),
        "model_config": GPT2Config(n_layer=3),
    }
    with single_process():
        model = FakeModel(0.0)
        state.register_model(model)
        smp.save_checkpoint(tmp_path / "ckpt", "t", model=model, user_content=content)
        loaded = smp.resume_from_checkpoint(tmp_path / "ckpt")
        assert loaded["num_params"] == 167680 and loaded["num_params"].dtype == np.int64
        assert loaded["loss"] == np.float32(6.4)
        np.testing.assert_array_equal(loaded["seen"], content["seen"])
        assert loaded["model_config"].n_layer == 3

        objects = {"rows": np.array([{"a": 1}], dtype=object)}
        smp.save_checkpoint(tmp_path / "objects", "t", model=model, user_content=objects)
        with pytest.raises(Exception, match="Weights only load failed"):
            smp.resume_from_checkpoint(tmp_path / "objects")
        smp.save(Path("x"), tmp_path / "path.pt", partial=False)
        with pytest.raises(Exception, match="Weights only load failed"):
            smp.load(tmp_path / "path.pt", partial=False)
        old_format = tmp_path / "old.pt"  # torch's format before zip files: loads as before
        torch.save({"w": torch.ones(2), "n": 3}, old_format, _use_new_zipfile_serialization=False)
        assert smp.load(old_format, partial=False)["n"] == 3


def test_a_file_naming_a_config_transformers_lacks_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config class under a module this transformers does not have (a newer version's, or
    planted): torch's refusal, not an import error; a name outside transformers' table of
    configs is not imported at all."""
    pytest.importorskip("transformers")
    for module_name, class_name in (
        ("transformers.models.newmodel.configuration_newmodel", "GPT2Config"),
        ("transformers.models.gpt2.configuration_gpt2", "NotAConfig"),
    ):
        module = types.ModuleType(module_name)
        made = type(class_name, (), {"__module__": module_name})
        setattr(module, class_name, made)
        with monkeypatch.context() as patch:  # there while saving only
            patch.setitem(sys.modules, module_name, module)
            torch.save({"config": made()}, tmp_path / "new.pt")
        with single_process(), pytest.raises(Exception, match="Weights only load failed"):
            smp.load(tmp_path / "new.pt", partial=False)

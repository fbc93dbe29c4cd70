"""``tsm.init`` names the script's modules that hold torch's own FSDP, imported before
``torch.sagemaker`` replaced the names; installed libraries and dtrain are not the script's."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import pytest
import torch

from dtrain.smpv2.bindings import TORCH_FSDP, modules_holding_torch_fsdp

AddModule = Callable[..., None]


@pytest.fixture
def add_module(monkeypatch: pytest.MonkeyPatch) -> AddModule:
    """Put a module named ``name`` from ``file`` with the globals ``names`` in ``sys.modules``
    for this test."""

    def add(name: str, file: str | None, **names: object) -> None:
        module = types.ModuleType(name)
        if file is not None:
            module.__file__ = file
        vars(module).update(names)
        monkeypatch.setitem(sys.modules, name, module)

    return add


def test_the_scripts_modules_holding_torchs_fsdp_are_named(add_module: AddModule) -> None:
    fsdp1, fsdp2 = TORCH_FSDP
    add_module("train_lib_early", "/job/code/train_lib_early.py", FSDP=fsdp1)
    add_module("fsdp2_early", "/job/code/fsdp2_early.py", shard=fsdp2)
    add_module("train_lib_late", "/job/code/train_lib_late.py", FSDP=object())
    library = str(torch.__file__).replace("__init__.py", "fake_library.py")
    add_module("torch.fake_library", library, FSDP=fsdp1)
    add_module("builtin_like", None, FSDP=fsdp1)
    add_module("dtrain.fake", "/work/src/dtrain/fake.py", FSDP=fsdp1)
    found = modules_holding_torch_fsdp()
    assert "train_lib_early" in found and "fsdp2_early" in found
    assert not {"train_lib_late", "torch.fake_library", "builtin_like", "dtrain.fake"} & set(found)

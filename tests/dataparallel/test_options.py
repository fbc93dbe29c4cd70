"""Choices made without processes: hierarchical or flat, the wire codec, constructor checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.dataparallel import DistributedDataParallel
from dtrain.dataparallel.compression import Codec
from dtrain.dataparallel.hierarchical import HIERARCHICAL_ENV, wants_hierarchical


@pytest.mark.parametrize(
    ("world", "local", "expected"),
    [(4, 2, True), (2, 2, False), (4, 1, False), (8, 4, True)],
)
def test_auto_hierarchical_needs_several_hosts_with_several_processes(
    world: int, local: int, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(HIERARCHICAL_ENV, raising=False)
    assert wants_hierarchical(None, world, local, spans_world=True) is expected


def test_env_var_and_argument_override_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HIERARCHICAL_ENV, "0")
    assert not wants_hierarchical(None, 4, 2, spans_world=True)
    monkeypatch.setenv(HIERARCHICAL_ENV, "1")
    assert wants_hierarchical(None, 2, 2, spans_world=True)
    assert not wants_hierarchical(False, 4, 2, spans_world=True)


def test_sub_groups_stay_flat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HIERARCHICAL_ENV, raising=False)
    assert not wants_hierarchical(None, 4, 2, spans_world=False)
    with pytest.raises(ValueError, match="hierarchical=False"):
        wants_hierarchical(True, 4, 2, spans_world=False)


def test_codec_pre_divides_and_casts() -> None:
    bucket = torch.tensor([70000.0, 3.0, 1e-3])
    wire = Codec.named("fp16").encode(bucket, world_size=4)
    assert wire.dtype == torch.float16
    assert torch.isfinite(wire).all(), "pre-division keeps 70000 inside fp16's range"
    Codec.named("fp16").decode(wire, bucket)
    assert bucket.dtype == torch.float32
    assert torch.allclose(bucket, torch.tensor([17500.0, 0.75, 2.5e-4]), rtol=2.0**-11)


def test_uncompressed_wire_is_the_bucket_itself() -> None:
    bucket = torch.tensor([2.0, 4.0])
    assert Codec.named(None).encode(bucket, world_size=2) is bucket
    assert torch.equal(bucket, torch.tensor([1.0, 2.0]))
    half = torch.tensor([2.0], dtype=torch.bfloat16)
    assert Codec.named("fp16").encode(half, world_size=2) is half, "never widen a 16-bit bucket"


def test_unknown_compression_is_rejected() -> None:
    with pytest.raises(ValueError, match="fp16"):
        Codec.named("int8")


def test_wrapping_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(nn.Linear(2, 2))

"""What the ranks of a tensor-parallel group compare of a region's further inputs before gathering
them (``tensor/batch.py``'s ``agree``): without processes, since each rank's signature is a pure
function of its input and the ranks compare the signatures as they are."""

from __future__ import annotations

import pytest
import torch

from dtrain.modelparallel.tensor import batch

UNUSUAL = [
    (torch.int16, torch.uint8),
    (torch.int32, torch.complex64),
    (torch.float8_e4m3fn, torch.float8_e5m2),
    (torch.uint16, torch.uint32),
]
"""Pairs of dtypes beyond the usual float, bool and int64 ones, one on each rank."""


@pytest.mark.parametrize(("one", "other"), UNUSUAL, ids=str)
def test_two_different_dtypes_differ_and_are_named(one: torch.dtype, other: torch.dtype) -> None:
    """A shared code would let the ranks pass the check and gather mismatched bytes."""
    mine, theirs = (batch._signature(torch.empty(4, 2, dtype=dtype)) for dtype in (one, other))
    assert mine != theirs
    assert batch._described(mine) == f"4 rows of {one}"
    assert batch._described(theirs) == f"4 rows of {other}"


def test_an_absent_input_and_a_scalar_are_told_apart() -> None:
    assert batch._described(batch._signature(None)) == "none"
    assert batch._described(batch._signature(torch.tensor(1.0))) == "-1 rows of torch.float32"

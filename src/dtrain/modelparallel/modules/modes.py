"""The thread-local compute modes a step's work must run under, wherever it runs.

Grad mode and autocast are per thread in PyTorch. A pipeline runs the step body on pool threads
and serves remote calls on other ranks' threads, so without care a ``torch.no_grad()`` or
``torch.autocast`` around (or inside) the step would silently not apply there: partition 1
computing in float32 while partition 0 sends bfloat16, or building graphs under ``no_grad``.
A :class:`ComputeMode` is read on the thread that has the mode, travels with each task and
request (as plain values), and is applied where the work runs.

Tensor parallelism's scaled-batch region (:mod:`..tensor.batch`) is such a mode too: a module
the region calls on another partition gets the tp group's combined batch, which it must not
gather again. The mark lives here, so the pipeline carries it without importing DTensor.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Autocast:
    """One device type's enabled autocast region."""

    device_type: str
    dtype: str
    """A ``torch`` dtype's name (``"bfloat16"``), so the mode travels as plain values."""
    cache: bool


_region = threading.local()


def in_tensor_region() -> bool:
    """Whether the calling thread computes inside a tensor-parallel scaled-batch region."""
    return getattr(_region, "inside", False)


@contextlib.contextmanager
def tensor_region(inside: bool = True) -> Iterator[None]:
    """Mark (or, ``inside`` false, unmark) the block as inside a scaled-batch region."""
    before = in_tensor_region()
    _region.inside = inside
    try:
        yield
    finally:
        _region.inside = before


@dataclass(frozen=True)
class ComputeMode:
    grad: bool = True
    autocast: tuple[Autocast, ...] = ()
    tensor_region: bool = False

    @classmethod
    def current(cls) -> ComputeMode:
        """The modes of the calling thread."""
        regions = tuple(
            Autocast(
                device_type,
                str(torch.get_autocast_dtype(device_type)).removeprefix("torch."),
                torch.is_autocast_cache_enabled(),
            )
            for device_type in AUTOCAST_DEVICE_TYPES
            if torch.is_autocast_enabled(device_type)
        )
        return cls(torch.is_grad_enabled(), regions, in_tensor_region())

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block under these modes (autocast regions the thread has are turned off)."""
        wanted = {region.device_type: region for region in self.autocast}
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            stack.enter_context(tensor_region(self.tensor_region))
            for device_type in AUTOCAST_DEVICE_TYPES:
                region = wanted.get(device_type)
                if region is not None:
                    stack.enter_context(
                        torch.autocast(
                            device_type,
                            dtype=getattr(torch, region.dtype),
                            cache_enabled=region.cache,
                        )
                    )
                elif torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            yield

    def to_wire(self) -> dict[str, Any]:
        return {
            "grad": self.grad,
            "autocast": [[r.device_type, r.dtype, r.cache] for r in self.autocast],
            "tensor_region": self.tensor_region,
        }

    @classmethod
    def from_wire(cls, value: dict[str, Any]) -> ComputeMode:
        regions = []
        for device_type, dtype, cache in value["autocast"]:
            if device_type not in AUTOCAST_DEVICE_TYPES or not isinstance(
                getattr(torch, str(dtype), None), torch.dtype
            ):
                raise ValueError(f"unknown autocast region {device_type!r}/{dtype!r}")
            regions.append(Autocast(device_type, str(dtype), bool(cache)))
        return cls(bool(value["grad"]), tuple(regions), bool(value["tensor_region"]))

"""What a bucket looks like on the wire: averaged by pre-division, optionally in 16 bits.

Every rank divides its bucket by the world size *before* the sum, so the collective's result is
already the average. With 16-bit compression this also keeps the sum in range: fp16 overflows
at 65504, and a sum of W gradients can be W times larger than any one of them, while the sum of
pre-divided values is at most the largest one. Local accumulation (``no_sync``) and the result
written back to ``param.grad`` stay in the parameter's dtype; only the wire is 16-bit.

Error of the averaged gradient (derivation, checked by tests/dataparallel): with unit roundoff
``u`` (fp16 ``2**-11``, bf16 ``2**-8``), casting ``v_r = g_r / W`` costs at most ``u |v_r|`` and
each of the at most ``W - 1`` additions of the collective (ring or tree) at most ``u`` times the
partial sum, so ``|avg_wire - avg_exact| <= gamma_W * sum_r |v_r| = gamma_W * mean_r |g_r|``
with ``gamma_W = W u / (1 - W u)``. fp16 values below ``2**-14`` are subnormal and rounded
with absolute error up to ``2**-25`` each, adding ``W * 2**-25``; bf16 shares fp32's range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WIRE_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Codec:
    """Turns a bucket into the tensor that is reduced, and the reduced tensor back into a bucket."""

    wire_dtype: torch.dtype | None = None

    @classmethod
    def named(cls, compression: str | None) -> Codec:
        """``None`` (full precision), ``"fp16"`` or ``"bf16"``."""
        if compression is None:
            return cls()
        if compression not in WIRE_DTYPES:
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")
        return cls(WIRE_DTYPES[compression])

    def encode(self, bucket: torch.Tensor, world_size: int) -> torch.Tensor:
        """Pre-divide ``bucket`` in place; return the wire tensor (the bucket if uncompressed).

        The bucket's contents are consumed: ``decode`` overwrites them with the average.
        """
        bucket.div_(world_size)
        return self.to_wire(bucket)

    def to_wire(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` in the wire dtype: the tensor itself when uncompressed or already narrow."""
        if self.wire_dtype is None or values.element_size() <= self.wire_dtype.itemsize:
            return values
        return values.to(self.wire_dtype)

    def decode(self, wire: torch.Tensor, bucket: torch.Tensor) -> None:
        """Write the reduced wire tensor back into the bucket in the bucket's dtype."""
        if wire is not bucket:
            bucket.copy_(wire)

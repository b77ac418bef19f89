"""float32 -> bfloat16 without torch, bit for bit as torch does it, so the commonest cast needs no torch import.

torch turns a float32 that is not NaN into bfloat16 by rounding its bit pattern to nearest, ties to
even: `(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16` (checked against torch for all 2**32 patterns). NaN
is the exception: torch's CPU kernels encode it differently from one another (0x7FC0, 0xFFFF, or the
payload kept), so a chunk holding a NaN is left to torch. Importing torch costs seconds per process
(twice that on two ranks sharing two cores); numpy costs a tenth of a second. Finite values from
bfloat16's overflow threshold up round to ±inf: they are counted (see `workbench.overflow`).
"""

from __future__ import annotations

from typing import Any

from ..dtypes import numpy_castable
from ..overflow import limits

__all__ = ["BLOCK", "Float32ToBFloat16", "numpy_castable"]

BLOCK = 1 << 16  # elements converted per numpy call: the scratch stays in the CPU cache


class Float32ToBFloat16:
    """A converter with its own small scratch buffer (reused for every chunk of a rank)."""

    def __init__(self) -> None:
        import numpy as np

        self._np = np
        self._scratch = np.empty(BLOCK, dtype=np.uint32)
        self._high = np.float32(limits("BF16")[1])  # from here float32 values round beyond bfloat16's largest: inf

    def convert(self, src: Any, out: Any, count: int) -> tuple[int, float] | None:
        """Write `count` bfloat16 values into `out` from the float32 values in `src` (buffers of bytes).

        Returns (finite values that overflowed to ±inf, the largest magnitude among them), or None when `src`
        holds a NaN: `out` is then incomplete and the caller must use torch.
        """
        np = self._np
        bits = np.frombuffer(src, dtype=np.uint32, count=count)
        values = bits.view(np.float32)
        result = np.frombuffer(out, dtype=np.uint16, count=count)
        overflowed, largest = 0, 0.0
        for start in range(0, count, BLOCK):
            block = bits[start : start + BLOCK]
            block_values = values[start : start + BLOCK]
            top = block_values.max()
            if np.isnan(top):  # max propagates NaN: one pass finds any
                return None
            if top >= self._high or block_values.min() <= -self._high:  # rare: count this block element by element
                magnitudes = np.abs(block_values)
                found = magnitudes[(magnitudes >= self._high) & np.isfinite(magnitudes)]
                if found.size:
                    overflowed, largest = overflowed + int(found.size), max(largest, float(found.max()))
            work = self._scratch[: len(block)]
            np.right_shift(block, 16, out=work)
            work &= 1
            work += 0x7FFF
            work += block
            np.right_shift(work, 16, out=result[start : start + BLOCK], casting="unsafe")
        return overflowed, largest

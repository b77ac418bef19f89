"""A quantised tensor converted by rows beside its scales: the skeleton every dequantising row job shares.

FP8 block scales, MXFP4 experts, compressed-tensors packed weights and GPTQ / AWQ linears all read one tensor a
chunk of rows at a time (`mapper.row_jobs`) with a few small tensors read whole beside it (a scale grid, zero
points, a global scale, g_idx), and hold the chunk in and out, those tensors and a kernel's scratch. Only how many
rows make a chunk, what the scratch is and the converter differ: `ScaledRows` is the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...catalog import TensorInfo


class ScaledRows:
    """A row job (`mapper.row_jobs.RowJob`) of one stored tensor read by rows and the tensors `whole` read whole
    beside it, into `output` in `code`. Subclasses give `converter` and, when they differ from the default,
    `chunk_rows` (the smallest unit of rows) and `scratch` (the kernel's bytes beside the chunk)."""

    libraries: tuple[str, ...] = ("ml_dtypes",)
    library_bytes = 0  # beyond ml_dtypes, which planning.rss counts (rss_calibration.ML_DTYPES_BYTES)
    library_detail = "ml_dtypes: quantised weights dequantised by rows"

    def __init__(self, tensor: TensorInfo, output: TensorInfo, whole: Sequence[TensorInfo], code: str) -> None:
        self.inputs, self.output, self.code = (tensor,), output, code
        self.extra = tuple(whole)
        self.overflow_dtype = self.value_dtype = code

    @property
    def rows(self) -> int:
        return self.inputs[0].shape[0]

    @property
    def in_row(self) -> int:
        return self.inputs[0].nbytes // max(1, self.rows)

    @property
    def out_row(self) -> int:
        return self.output.nbytes // max(1, self.rows)

    def whole(self, k: int) -> tuple[TensorInfo, ...]:
        return self.extra

    def budget(self, chunk_bytes: int) -> int:
        return chunk_bytes

    def chunk_rows(self, budget: int) -> int:
        return max(1, min(self.rows, budget // max(1, self.in_row + self.out_row)))

    def scratch(self, rows: int) -> int:
        """The kernel's bytes beside the chunk and the whole tensors (decoded copies, float32 pieces)."""
        return 0

    def held(self, rows: int) -> int:
        """The chunk in and out, the tensors read whole, and the kernel's scratch."""
        return rows * (self.in_row + self.out_row) + sum(t.nbytes for t in self.extra) + self.scratch(rows)

    def held_bytes(self, chunk_bytes: int) -> int:
        return self.held(self.chunk_rows(self.budget(chunk_bytes)))

    def converter(self, rows: int) -> Any:  # pragma: no cover - every subclass gives its own
        raise NotImplementedError


__all__ = ["ScaledRows"]

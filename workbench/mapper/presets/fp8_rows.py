"""Dense FP8 weights dequantised by row blocks: the row job (`mapper.row_jobs`) of `dequantize_fp8_tensor`.

A dense FP8 weight with 128 x 128 block scales (DeepSeek-V3's dense MLP: 18432 x 7168, 126 MB in, 252 MB out in
bf16) was computed whole: its input, its output and the scales held at once. Its rows are independent once their
tile row of scales is known, so a step reads whole blocks of rows raw, multiplies them by their scales (read whole
beside them, a few KiB) and writes the bf16 rows at their place: it holds one chunk, and ranks can share the tensor
by row chunks (`planning.parts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...catalog import TensorInfo
from .scaled_rows import ScaledRows

PIECE = 1 << 16  # as quantized.PIECE: float32 values the kernel converts at a time


class Fp8Rows(ScaledRows):
    """The row job of a dense 2-D FP8 weight and its scale grid: chunks of whole tile rows (`block[0]` rows)."""

    library_detail = "ml_dtypes: FP8 weights dequantised by rows"

    def __init__(self, weight: TensorInfo, scales: TensorInfo, output: TensorInfo, block: tuple[int, int], code: str,
                 kernel: Callable[..., Any], numpy_dtype: Callable[[str], Any]) -> None:
        super().__init__(weight, output, (scales,), code)
        self.scales, self.block = scales, block
        self.kernel, self.numpy_dtype = kernel, numpy_dtype  # quantized.dequantize_fp8_tensor and its dtype table

    def chunk_rows(self, budget: int) -> int:
        b0 = self.block[0]
        return min(self.rows, max(1, budget // (b0 * (self.in_row + self.out_row))) * b0)  # whole tile rows

    def scratch(self, rows: int) -> int:
        return 4 * (PIECE + self.inputs[0].shape[1])  # a float32 piece and a row of scales

    def converter(self, rows: int) -> Any:
        import numpy as np

        weight, b0, kernel = self.inputs[0], self.block[0], self.kernel
        cols, grid, in_dtype = weight.shape[1], self.scales.shape, self.numpy_dtype(weight.dtype)
        scale_dtype = self.numpy_dtype(self.scales.dtype)

        def convert(k: int, first: int, raw: Any, whole: Any) -> tuple[Any, int, float]:
            values = np.frombuffer(raw, in_dtype).reshape(-1, cols)
            tile = first // b0
            scales = np.frombuffer(whole[0], scale_dtype).reshape(grid)[tile: tile + -(-values.shape[0] // b0)]
            out = kernel(values, scales, block=self.block, dtype=self.code)
            return np.ascontiguousarray(out).reshape(-1).view(np.uint8), 0, 0.0

        return convert


def fp8_rows(op: Any, group: Any, ahead: tuple[Any, ...], *, kernel: Callable[..., Any], numpy_dtype: Callable[[str], Any],
             output_code: Callable[[Any], str]) -> Fp8Rows | None:
    """The row job of a dense FP8 group (a 2-D float8 weight and its float scale grid, nothing after), None otherwise.
    `kernel`, `numpy_dtype`, `output_code`: `quantized`'s (given, so this module imports nothing of it)."""
    if ahead or len(group.inputs) != 2 or len(group.outputs) != 1:
        return None
    infos = {info.name: info for info in group.inputs}
    weight, scales = infos.get(op.inputs[0]), infos.get(op.inputs[1])
    if weight is None or scales is None or len(weight.shape) != 2 or weight.shape[0] < 2 or not weight.dtype.startswith("F8"):
        return None
    kwargs = op.kwargs
    block = kwargs.get("block")
    if not isinstance(block, (list, tuple)) or len(block) != 2 or scales.dtype not in ("F32", "BF16", "F16"):
        return None
    output = group.outputs[0]
    if tuple(output.shape) != tuple(weight.shape) or output.dtype != output_code(kwargs.get("dtype", "BF16")):
        return None
    return Fp8Rows(weight, scales, output, (int(block[0]), int(block[1])), output.dtype, kernel, numpy_dtype)


__all__ = ["Fp8Rows", "fp8_rows"]

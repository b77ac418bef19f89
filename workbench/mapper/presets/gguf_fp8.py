"""FP8 block-quantised HF checkpoints (DeepSeek-V3, Qwen3-FP8) on their way to GGUF.

Such a folder stores each linear weight `X.weight` as float8_e4m3fn beside `X.weight_scale_inv` (float32, one
scale per `quantization_config.weight_block_size` tile; the last tile of a dimension may be partial), and says
`quantization_config.quant_method: "fp8"` in config.json. llama.cpp's converter de-quantises those weights first,
to float32 (the float8 value times its tile's scale, one float32 multiplication), drops the scales and the unused
activation scales, and then treats the float32 tensor as any other: permuted, stacked, cast or quantised to the
`--outtype` (it leaves the metadata as for the unquantised model). The GGUF preset does the same: a first step of
`quantized.dequantize_fp8_tensor` ops (dtype F32) in front of its own, which the planner shows. The row path
(`gguf_rows.row_job`) recognises a de-quantisation followed by the row conversion and runs both a row chunk at a
time with numpy (`dequantize_rows`), so the file is the converter's, byte for byte, without torch.
"""

from __future__ import annotations

from typing import Any

from ...catalog import TensorInfo
from ...errors import MapperError
from ..function import Function

DEQUANTIZE_FN = "workbench.mapper.presets.quantized:dequantize_fp8_tensor"
DEQUANTIZE_INFER = "workbench.mapper.presets.quantized:infer_dequantize_fp8"
SCALE_SUFFIX = "_scale_inv"
FP8_TYPES = ("F8_E4M3", "F8_E5M2")  # float8 codes a block-scaled checkpoint may store


def _config_get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def fp8_block(config: Any) -> tuple[int, int] | None:
    """The (rows, cols) FP8 block of a checkpoint whose config says `quant_method: "fp8"`; None for an
    unquantised one. Refuses another quantisation method, or FP8 without a block size, naming what to do."""
    quant = _config_get(config, "quantization_config")
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else {}
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise MapperError(f"Cannot write GGUF from a checkpoint quantised with quant_method {method!r}: the workbench "
                          "de-quantises FP8 block scales (quant_method 'fp8') only. Use llama.cpp's convert_hf_to_gguf.py, "
                          "or de-quantise the folder first.")
    block = quant.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise MapperError(f"Cannot write GGUF from this FP8 checkpoint: quantization_config.weight_block_size is {block!r}, "
                          "but the workbench de-quantises block scales ([rows, cols], e.g. [128, 128]) only. Use "
                          "llama.cpp's convert_hf_to_gguf.py for per-tensor or per-channel FP8 scales.")
    return int(block[0]), int(block[1])


def dequantized(source: Any, name: str, block: tuple[int, int] | None, ops: list[Function]) -> TensorInfo:
    """The tensor `name` of `source` as the GGUF preset sees it: an FP8 weight with scales (in an FP8 checkpoint)
    becomes F32, and the op de-quantising it is appended to `ops`; any other tensor is returned as it is. A
    float8 tensor that cannot be de-quantised is refused, naming it."""
    info = source[name]
    scale = name + SCALE_SUFFIX
    if block is not None and scale in source:
        ops.append(Function(DEQUANTIZE_FN, (name, scale), (name,), infer=DEQUANTIZE_INFER,
                            params=(("block", list(block)), ("dtype", "F32"))))
        return TensorInfo(name, "F32", tuple(info.shape))
    if info.dtype.startswith("F8") or info.dtype in ("F4", "F6_E2M3", "F6_E3M2"):
        why, fix = ((f"no {scale!r} lies beside it", "Add the missing scales (is a shard of the checkpoint missing?)")
                    if block is not None else
                    ("config.json has no quantization_config with quant_method 'fp8' and a weight_block_size",
                     "Give config.json the quantization_config the checkpoint was made with"))
        raise MapperError(f"Cannot convert {name!r} ({info.dtype}) to GGUF: {why}, so its scales are unknown. {fix}, or "
                          "de-quantise it first.", tensor=name)
    return info


def dequant_params(op: Any) -> tuple[str, str, tuple[int, int]] | None:
    """(weight, scale, block) of a `dequantize_fp8_tensor` op to F32 in place (as `dequantized` makes), else None."""
    if not isinstance(op, Function) or op.fn != DEQUANTIZE_FN or len(op.inputs) != 2 or op.outputs != op.inputs[:1]:
        return None
    params = op.kwargs
    if params.get("dtype") != "F32":
        return None
    block = params.get("block")
    return op.inputs[0], op.inputs[1], (int(block[0]), int(block[1]))


def dequantize_rows(rows: Any, scales: Any, first: int, block: tuple[int, int], out: Any) -> Any:
    """float32 values of `rows` (float8, rows `first`.. of the weight, (n, cols)) times their tiles' scales
    (`scales`: the weight's float32 grid (row tiles, col tiles)), written into `out` (a float32 buffer of at
    least n * cols); one float32 multiplication per value, as the converter de-quantises."""
    import numpy as np

    n, cols = rows.shape
    b0, b1 = block
    target = out[: n * cols].reshape(n, cols)
    np.copyto(target, rows, casting="unsafe")  # float8 -> float32 is exact
    at = 0
    while at < n:
        tile = (first + at) // b0
        end = min(n, (tile + 1) * b0 - first)
        target[at:end] *= np.repeat(scales[tile], b1)[:cols]
        at = end
    return target


__all__ = ["DEQUANTIZE_FN", "FP8_TYPES", "SCALE_SUFFIX", "dequant_params", "dequantize_rows", "dequantized", "fp8_block"]

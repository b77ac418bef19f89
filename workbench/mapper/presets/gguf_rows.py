"""One GGUF tensor made from HF tensors a bounded number of rows at a time, with numpy alone.

llama.cpp's converter turns each HF tensor (or each layer's experts, stacked) into a GGUF tensor by three
row-wise steps: the Q/K row permutation (within one head's rows), a cast to float32, and the GGUF type
(F32, F16, BF16, or Q8_0 / Q4_0 blocks of 32 values along a row). None of them mixes rows across a head, so
any run of whole heads (whole rows when there is no permutation) is converted on its own: the engine reads,
converts and writes a GGUF tensor chunk by chunk (`engine.rows`), holding a few MiB whatever the model size,
and never imports torch. The conversion is the `gguf` package's own (`gguf.quants.quantize`), the bfloat16
reads are ml_dtypes', so the bytes are the converter's.

The preset (`mapper.presets.gguf_preset`) emits one `Function` naming `to_gguf` per such tensor; `row_job` recognises
it in a bound group (and nothing else: a user mapper composed ahead of it makes a group computed by torch), alone
or after the preset's FP8 de-quantisation of its inputs (`gguf_fp8`): then each chunk of float8 rows is first
multiplied by its tiles' scales in float32, as llama.cpp's converter de-quantises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...catalog import TensorInfo
from ...dtypes import nbytes_of, numpy_dtype  # numpy_dtype: exported here too (engine.rows)
from ...errors import MapperError
from ..compose import Parallel, Sequential
from ..function import Function

ROWS_FN = "workbench.mapper.presets.gguf_rows:to_gguf"
INFER_FN = "workbench.mapper.presets.gguf_rows:infer_to_gguf"
# Block-quantised types: (elements per block, bytes per block): an f16 scale + 32 int8 (Q8_0) or 4-bit (Q4_0) values.
QUANTIZED = {"Q8_0": (32, 34), "Q4_0": (32, 18)}
OUTPUT_TYPES = ("F32", "F16", "BF16", *QUANTIZED)
SOURCE_TYPES = ("BF16", "F16", "F32")  # read by numpy (bfloat16 through ml_dtypes)
# The gguf quantiser works through a chunk 16-31 rows at a time (`_apply_over_grouped_rows`), making a few
# float32 temporaries of such a group; this bounds them (rows, float32 copies).
QUANTISER_GROUP_ROWS, QUANTISER_TEMPORARIES = 32, 6
# Bytes a row conversion holds at most (a plan's smaller chunk size wins): 1 GiB of Q8_0 converted in 8 MiB chunks
# took no longer than in 32 MiB ones here, and the process stays ~25 MiB smaller.
ROW_BUDGET = 8 << 20


def row_budget(chunk_bytes: int) -> int:
    """The held-bytes budget of one row chunk under a plan's `chunk_bytes`."""
    return min(chunk_bytes, ROW_BUDGET)


def gguf_function(parts: tuple[str, ...], out: str, kind: str, heads: int = 0) -> Function:
    """The op making GGUF tensor `out` of type `kind` from HF tensor(s) `parts` (several: stacked experts),
    with llama.cpp's q/k row permutation over `heads` heads when `heads` > 0."""
    return Function(ROWS_FN, parts, (out,), infer=INFER_FN, params=(("heads", heads), ("kind", kind)))


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, elements per row) of a tensor converted row-wise: a vector is one row."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def output_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """Byte shape (U8) of a block-quantised tensor; the logical shape otherwise."""
    if kind not in QUANTIZED:
        return shape
    block, size = QUANTIZED[kind]
    return (*shape[:-1], shape[-1] // block * size)


def row_bytes(cols: int, kind: str) -> int:
    """Output bytes of one row of `cols` values."""
    if kind in QUANTIZED:
        block, size = QUANTIZED[kind]
        return cols // block * size
    return nbytes_of(kind, cols)


def infer_to_gguf(*infos: TensorInfo, kind: str, heads: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """Output metadata of `to_gguf`: (dtype, shape); MapperError naming the tensor when it cannot be made."""
    first = infos[0]
    for info in infos:
        if info.dtype not in SOURCE_TYPES:
            raise MapperError(f"Cannot convert {info.name!r} to GGUF {kind}: it is {info.dtype}; the GGUF path reads "
                              f"{', '.join(SOURCE_TYPES)}. Cast it first (M.Cast) or use llama.cpp's converter.", tensor=info.name)
        if (info.dtype, tuple(info.shape)) != (first.dtype, tuple(first.shape)):
            raise MapperError(f"Cannot stack {info.name!r} ({info.dtype} {list(info.shape)}) with {first.name!r} ({first.dtype} "
                              f"{list(first.shape)}) into one GGUF tensor: experts must share dtype and shape.", tensor=info.name)
    if kind not in OUTPUT_TYPES:
        raise MapperError(f"Cannot convert {first.name!r} to GGUF type {kind!r}: choose one of {', '.join(OUTPUT_TYPES)}.", tensor=first.name)
    shape = tuple(first.shape)
    rows, cols = _rows_cols(shape)
    if heads and (len(shape) < 1 or shape[0] % (2 * heads)):
        raise MapperError(f"Cannot permute {first.name!r} {list(shape)} for {heads} heads: its rows are not whole pairs of "
                          "half-heads. Check num_attention_heads / num_key_value_heads in config.json.", tensor=first.name)
    if kind in QUANTIZED and cols % QUANTIZED[kind][0]:
        raise MapperError(f"Cannot quantise {first.name!r} {list(shape)} to {kind}: its rows are not whole blocks of "
                          f"{QUANTIZED[kind][0]}. Keep it F16.", tensor=first.name)
    full = (len(infos), *shape) if len(infos) > 1 else shape
    return [("U8" if kind in QUANTIZED else kind, output_shape(full, kind))]


@dataclass(frozen=True)
class RowJob:
    """A group the engine converts row chunk by row chunk: its inputs in stacking order, the output, the GGUF type."""

    inputs: tuple[TensorInfo, ...]
    output: TensorInfo
    kind: str
    heads: int
    scales: tuple[TensorInfo, ...] = ()  # FP8 inputs: each one's float32 scale grid (read whole), in input order
    block: tuple[int, int] = (0, 0)  # FP8 inputs: the (rows, cols) tile of one scale

    @property
    def rows(self) -> int:
        """Rows of one input."""
        return _rows_cols(tuple(self.inputs[0].shape))[0]

    @property
    def cols(self) -> int:
        """Values per row."""
        return _rows_cols(tuple(self.inputs[0].shape))[1]

    @property
    def unit(self) -> int:
        """Rows converted together at least: one head's rows when permuted (the permutation stays within them)."""
        return self.inputs[0].shape[0] // self.heads if self.heads else 1

    def held(self, rows: int) -> int:
        """Bytes held while converting `rows` rows: the bytes read, their float32 copy, the quantiser's result
        (its row groups, then the joined array) and its scratch for one row group."""
        src = nbytes_of(self.inputs[0].dtype, rows * self.cols)
        out = rows * row_bytes(self.cols, self.kind)
        scratch = QUANTISER_GROUP_ROWS * self.cols * 4 * QUANTISER_TEMPORARIES if self.kind != "F32" else 0
        if self.scales:  # the de-quantised float32 rows, one scale grid and one row of expanded scales (whole tiles)
            scratch += 4 * rows * self.cols + self.scales[0].nbytes + 4 * (self.cols + self.block[1])
        return src + 4 * rows * self.cols + 2 * out + scratch

    def chunk_rows(self, budget: int) -> int:
        """Rows per chunk: whole units, as many as keep `held` within `budget` (one unit at least), at most all."""
        per_unit = self.held(self.unit) - self.held(0)
        units = max(1, (budget - self.held(0)) // per_unit) if per_unit else 1
        return min(self.rows, units * self.unit)

    def held_bytes(self, chunk_bytes: int) -> int:
        """What the plan counts for this step: the held bytes of one chunk under `row_budget(chunk_bytes)`."""
        return self.held(self.chunk_rows(row_budget(chunk_bytes))) if self.rows else 0


def row_job(group: Any) -> RowJob | None:
    """The row-wise GGUF conversion `group` is, or None (any other op, or extra ops around it). The conversion
    may follow the FP8 de-quantisation (to F32, in place) of every one of its inputs, with one block."""
    from .gguf_fp8 import dequant_params

    op = group.op
    while isinstance(op, Sequential) and len(op.mappers) == 1:
        op = op.mappers[0]
    dequant: dict[str, tuple[str, tuple[int, int]]] = {}
    if isinstance(op, Sequential):
        *first, op = op.mappers
        for step in (leaf for part in first for leaf in (part.mappers if isinstance(part, Parallel) else (part,))):
            found = dequant_params(step)
            if found is None:
                return None
            dequant[found[0]] = found[1:]
    if not isinstance(op, Function) or op.fn != ROWS_FN or len(group.outputs) != 1:
        return None
    by_name = {t.name: t for t in group.inputs}
    scale_names = [dequant[n][0] for n in op.inputs if n in dequant]
    blocks = {dequant[n][1] for n in op.inputs if n in dequant}
    if set(by_name) != set(op.inputs) | set(scale_names) or set(dequant) - set(op.inputs) or len(blocks) > 1:
        return None
    if dequant and (len(dequant) != len(op.inputs) or len({by_name[s].nbytes for s in scale_names}) != 1
                    or any(len(by_name[n].shape) != 2 for n in op.inputs)):
        return None  # de-quantised inputs are all or none, 2-D, with scale grids alike
    params = dict(op.params)
    return RowJob(tuple(by_name[n] for n in op.inputs), group.outputs[0], params["kind"], int(params.get("heads", 0)),
                  tuple(by_name[s] for s in scale_names), next(iter(blocks)) if blocks else (0, 0))


def permuted_float32(rows: Any, heads: int, out: Any = None) -> Any:
    """`rows` (rows, cols; whole heads when `heads`) as float32, q/k rows in llama.cpp's order: per head, the rows
    (2, half) become (half, 2). `out`: a float32 buffer of at least that size to fill (reused across chunks)."""
    import numpy as np

    n, cols = rows.shape
    target = np.empty((n, cols), np.float32) if out is None else out[: n * cols].reshape(n, cols)
    if heads:
        half = n // heads // 2
        np.copyto(target.reshape(heads, half, 2, cols), rows.reshape(heads, 2, half, cols).swapaxes(1, 2))
    else:
        np.copyto(target, rows)
    return target


def convert_rows(rows: Any, kind: str, heads: int = 0, scratch: Any = None, counted: bool = False) -> tuple[Any, int, float]:
    """(GGUF bytes of `rows` as uint8, values that overflowed `kind`, the largest magnitude among them).

    `rows`: a (rows, cols) numpy array of the source dtype holding whole heads when `heads` (the heads it holds).
    `counted`: count the values that overflow (`overflow.may_overflow(source dtype, kind)`).
    """
    import gguf
    import numpy as np

    values = permuted_float32(rows, heads, scratch)
    with np.errstate(over="ignore"):  # values beyond F16 become inf, as in llama.cpp; they are counted below
        converted = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
    count, largest = _overflowed(values, converted, kind) if counted and kind in ("F16", "BF16") else (0, 0.0)
    return np.ascontiguousarray(converted).reshape(-1).view(np.uint8), count, largest


def _overflowed(values: Any, converted: Any, kind: str) -> tuple[int, float]:
    """Finite float32 `values` that became ±inf in `converted` (F16 / BF16)."""
    import numpy as np

    from ...overflow import limits

    wide = converted.view(np.float16) if kind == "F16" else (converted.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if np.isfinite(wide).all() or not np.isfinite(values).any():
        return 0, 0.0
    high = limits(kind)[1]
    magnitudes = np.abs(values)
    found = magnitudes[(magnitudes >= high) & np.isfinite(magnitudes)]
    return int(found.size), float(found.max()) if found.size else 0.0


def to_gguf(*tensors: Any, kind: str, heads: int = 0) -> Any:
    """`to_gguf` on whole torch tensors (verification, or a group with other ops): the same numpy conversion as
    the engine's row chunks, over each whole input, stacked. Returns a torch tensor (U8 for Q8_0 / Q4_0)."""
    import numpy as np
    import torch

    from ...dtypes import from_torch
    from ...overflow import may_overflow, report

    parts = []
    for tensor in tensors:
        code = from_torch(tensor.dtype)
        flat = tensor.detach().contiguous().cpu()
        raw = flat.view(torch.int16 if code in ("BF16", "F16") else torch.int32).numpy() if flat.numel() else np.empty(0, np.int16)
        rows, cols = _rows_cols(tuple(tensor.shape))
        data, count, largest = convert_rows(raw.view(numpy_dtype(code)).reshape(rows, cols), kind, heads,
                                            counted=may_overflow(code, kind))
        report(count, largest, kind)
        parts.append(data)
    (dtype, shape), = infer_to_gguf(*(TensorInfo(f"t{k}", from_torch(t.dtype), tuple(t.shape)) for k, t in enumerate(tensors)),
                                    kind=kind, heads=heads)
    joined = np.concatenate(parts) if len(parts) > 1 else parts[0]
    out = torch.from_numpy(joined.copy())
    return out.reshape(shape) if dtype == "U8" else out.view({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]).reshape(shape)


__all__ = ["INFER_FN", "OUTPUT_TYPES", "ROWS_FN", "RowJob", "SOURCE_TYPES", "convert_rows", "gguf_function", "infer_to_gguf",
           "numpy_dtype", "output_shape", "permuted_float32", "row_budget", "row_bytes", "row_job", "to_gguf"]

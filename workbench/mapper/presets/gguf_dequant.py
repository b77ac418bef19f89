"""One GGUF tensor turned back into HF tensor(s) a bounded number of rows at a time, with numpy and the `gguf` package.

The inverse of `gguf_rows`: a GGUF tensor's rows (values, or blocks of a quantised type: Q8_0, Q4_0, Q4_K, Q6_K, the
IQ*, TQ*, MXFP4 and NVFP4 types, ... every type `gguf.quants.dequantize` knows) are de-quantised to float32 by the `gguf` package, llama.cpp's q/k row
permutation is undone within each head (rows (half, 2) per head back to (2, half)), and the float32 values are
rounded once to the output dtype (numpy's and ml_dtypes' round-to-nearest-even, as torch's `.to()`). A stacked
expert tensor (experts, rows, columns) becomes one output per expert. No step mixes rows across a head or an expert,
so the engine runs it chunk by chunk (`engine.rows`) from the file's raw bytes, holding a few MiB whatever the
tensor's size, and never imports torch. The result is what transformers' GGUF loader computes (`dequantize`, then
its `_reverse_permute_weights`), bit for bit, in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...catalog import TensorInfo
from ...dtypes import nbytes_of
from ...errors import MapperError
from ..function import Function
from ..row_jobs import Converter

DEQUANTIZE_GGUF_FN = "workbench.mapper.presets.gguf_dequant:dequantize_gguf"
INFER_FN = "workbench.mapper.presets.gguf_dequant:infer_dequantize_gguf"
OUTPUT_DTYPES = ("F32", "F16", "BF16")
PLAIN = ("F32", "F16", "BF16")  # GGUF types whose stored elements are a safetensors dtype
# Peak bytes `gguf.quants.dequantize` allocates per float32 value it returns (its result included), by type: measured
# with tracemalloc on 64 x 1024 chunks (gguf 0.19, numpy 2.4; Q4_K's scale unpacking makes int64 temporaries), plus
# a byte or two for the copies around it (un-permuting, rounding); the IQ*, TQ* and FP4 types: 8.4-9 bytes on 256 x 1024
# chunks, 10-11.5 on 64 x 1024 (their grids' lookups included). Types not listed get the largest.
DEQUANT_BYTES_PER_VALUE = {"F32": 4, "F16": 6, "BF16": 11, "Q8_0": 11, "Q4_0": 11, "Q4_1": 12, "Q5_0": 12, "Q5_1": 12,
                           "Q2_K": 12, "Q3_K": 12, "Q4_K": 60, "Q5_K": 13, "Q6_K": 12, "IQ1_S": 12, "IQ1_M": 12, "IQ2_XXS": 12,
                           "IQ2_XS": 12, "IQ2_S": 12, "IQ3_XXS": 12, "IQ3_S": 12, "IQ4_NL": 12, "IQ4_XS": 12, "TQ1_0": 12,
                           "TQ2_0": 12, "MXFP4": 12, "NVFP4": 12}
ROW_BUDGET = 8 << 20  # bytes a row chunk holds at most (a plan's smaller chunk size wins), as the GGUF writer's
# ml_dtypes and the gguf package, imported and used on top of numpy (as gguf_rows.GGUF_LIBRARIES measured it)
GGUF_LIBRARIES = 8_110_000


def block_of(kind: str) -> tuple[int, int]:
    """(elements, bytes) per block of GGML type `kind`, from the installed `gguf` package's table."""
    from ...formats.gguf import ggml_types

    for name, block, size in ggml_types().values():
        if name == kind:
            return block, size
    raise MapperError(f"Cannot read GGUF type {kind!r}: the installed gguf package does not know it. Upgrade it: pip install -U gguf.")


def dequantizable(kind: str) -> bool:
    """Whether the installed `gguf` package de-quantises GGML type `kind` (`gguf.quants.dequantize` raises
    NotImplementedError for the others: Q8_1, Q8_K, the integer types in gguf 0.19)."""
    import gguf

    member = gguf.GGMLQuantizationType.__members__.get(kind)
    traits = getattr(gguf.quants, "_type_traits", None)
    return member is not None and (kind in ("F32", "F16") or traits is None or member in traits)


def stored_row_bytes(kind: str, cols: int) -> int:
    """Bytes one row of `cols` values takes in a GGUF tensor of type `kind`."""
    block, size = block_of(kind)
    return cols // block * size


def dequantize_gguf_function(name: str, outputs: tuple[str, ...], kind: str, shape: tuple[int, ...], dtype: str, heads: int = 0,
                       shift: float = 0.0) -> Function:
    """The op making HF tensor(s) `outputs` (several: one per expert of a stacked tensor) of `dtype` from GGUF tensor
    `name` of type `kind` and logical `shape`, undoing llama.cpp's q/k row permutation over `heads` when > 0 and
    subtracting `shift` in float32 (Gemma's norms, stored plus one)."""
    params: tuple[tuple[str, Any], ...] = (("kind", kind), ("shape", tuple(shape)), ("dtype", dtype), ("heads", heads))
    if shift:
        params += (("shift", float(shift)),)
    if len(outputs) > 1:
        params += (("experts", len(outputs)),)
    return Function(DEQUANTIZE_GGUF_FN, (name,), outputs, infer=INFER_FN, params=params)


def _split(shape: tuple[int, ...], experts: int) -> tuple[tuple[int, ...], int, int]:
    """(shape of one output, its rows, values per row) of a GGUF tensor of logical `shape` made into `experts`
    outputs (1: the tensor itself)."""
    one = tuple(shape[1:]) if experts > 1 else tuple(shape)
    cols = one[-1] if one else 1
    return one, (math.prod(one[:-1]) if one else 1), cols


def infer_dequantize_gguf(info: TensorInfo, *, kind: str, shape: tuple[int, ...], dtype: str, heads: int = 0,
                    experts: int = 1, shift: float = 0.0) -> list[tuple[str, tuple[int, ...]]]:
    """Output metadata of `dequantize_gguf`: (dtype, shape) per output; MapperError naming the tensor when it cannot be made."""
    shape = tuple(shape)
    if dtype not in OUTPUT_DTYPES:
        raise MapperError(f"Cannot de-quantise {info.name!r} to {dtype!r}: choose one of {', '.join(OUTPUT_DTYPES)}.", tensor=info.name)
    block, size = block_of(kind)
    if not dequantizable(kind):
        raise MapperError(f"Cannot de-quantise {info.name!r}: the installed gguf package has no de-quantiser for {kind}. "
                          "Upgrade it (pip install -U gguf), or drop the tensor with a mapper given ahead (M.Drop(name)).",
                          tensor=info.name)
    cols = shape[-1] if shape else 1
    if cols % block:
        raise MapperError(f"Cannot de-quantise {info.name!r} {list(shape)}: its rows are not whole {kind} blocks of {block}.",
                          tensor=info.name)
    stored = tuple(shape) if kind in PLAIN else (*shape[:-1], cols // block * size)
    if tuple(info.shape) != stored or info.dtype != (kind if kind in PLAIN else "U8"):
        raise MapperError(f"Cannot de-quantise {info.name!r}: it is {info.dtype} {list(info.shape)}, not the {kind} tensor of "
                          f"shape {list(shape)} the preset was built for. Build the preset from this file.", tensor=info.name)
    one, rows, _ = _split(shape, experts)
    if heads and (not one or one[0] % (2 * heads)):
        raise MapperError(f"Cannot undo llama.cpp's q/k permutation of {info.name!r} {list(shape)} for {heads} heads: its rows "
                          "are not whole pairs of half-heads. Check the GGUF's head counts.", tensor=info.name)
    count = experts if experts > 1 else 1
    return [(dtype, one)] * count


def dequantized_rows(raw: Any, kind: str, cols: int, heads: int, dtype: str, scratch: Any = None, shift: float = 0.0) -> Any:
    """Output bytes (uint8) of whole stored rows `raw` (uint8, rows x stored row bytes; whole heads when `heads`):
    de-quantised to float32 by `gguf.quants.dequantize`, q/k rows put back in HF order, `shift` subtracted in float32,
    rounded to `dtype`."""
    import gguf
    import numpy as np

    rows = raw.reshape(-1, stored_row_bytes(kind, cols)) if raw.size else raw.reshape(0, 0)
    n = rows.shape[0]
    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind]).reshape(n, cols)
    if heads:
        half = n // heads // 2
        target = np.empty((n, cols), np.float32) if scratch is None else scratch[: n * cols].reshape(n, cols)
        np.copyto(target.reshape(heads, 2, half, cols), values.reshape(heads, half, 2, cols).swapaxes(1, 2))
        values = target
    if shift:
        values = values - np.float32(shift)
    if dtype == "F32":
        out = np.ascontiguousarray(values, dtype=np.float32)
    elif dtype == "F16":
        out = values.astype(np.float16)
    else:
        import ml_dtypes

        out = values.astype(ml_dtypes.bfloat16)
    return out.reshape(-1).view(np.uint8)


@dataclass(frozen=True)
class DequantJob:
    """A GGUF tensor the engine de-quantises row chunk by row chunk (a `mapper.row_jobs.RowJob`): `inputs` are the
    byte ranges of its experts (the whole tensor when it is not stacked), each written whole into `outputs[k]`."""

    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    kind: str
    dtype: str
    heads: int
    shift: float = 0.0

    libraries = ("ml_dtypes", "gguf")
    library_bytes = GGUF_LIBRARIES
    library_detail = "ml_dtypes and the gguf package: GGUF tensors de-quantised by rows"
    overflow_dtype = "F32"  # float32 values rounded to F16 may overflow; counted as such by no one: GGUF F16 fits

    @property
    def output(self) -> TensorInfo:
        """The first output (the protocol's single output; `outputs` lists them all)."""
        return self.outputs[0]

    @property
    def value_dtype(self) -> str | None:
        """The outputs' element dtype."""
        return self.dtype

    @property
    def cols(self) -> int:
        """Values per row."""
        shape = tuple(self.outputs[0].shape)
        return shape[-1] if shape else 1

    @property
    def rows(self) -> int:
        """Rows of one input (one expert)."""
        shape = tuple(self.outputs[0].shape)
        return math.prod(shape[:-1]) if shape else 1

    @property
    def in_row(self) -> int:
        """Bytes of one stored row."""
        return stored_row_bytes(self.kind, self.cols)

    @property
    def out_row(self) -> int:
        """Bytes of one output row."""
        return nbytes_of(self.dtype, self.cols)

    @property
    def unit(self) -> int:
        """Rows converted together at least: one head's rows when the permutation is undone."""
        return self.rows // self.heads if self.heads else 1

    def whole(self, k: int) -> tuple[TensorInfo, ...]:
        """Nothing is read whole beside the rows."""
        return ()

    def budget(self, chunk_bytes: int) -> int:
        """The held-bytes budget of one chunk: the plan's chunk size, at most `ROW_BUDGET`."""
        return min(chunk_bytes, ROW_BUDGET)

    def held(self, rows: int) -> int:
        """Bytes held converting `rows` rows: the stored rows, what the de-quantiser allocates (its float32 result
        included), the un-permuted copy, the rounded output (a copy unless float32 rows are written as they are)."""
        count = rows * self.cols
        dequantizing = int(DEQUANT_BYTES_PER_VALUE.get(self.kind, max(DEQUANT_BYTES_PER_VALUE.values())) * count)
        permuted = 4 * count if self.heads else 0
        shifted = 4 * count if self.shift else 0
        return rows * self.in_row + dequantizing + permuted + shifted + (rows * self.out_row if self.dtype != "F32" or self.heads else 0)

    def chunk_rows(self, budget: int) -> int:
        """Rows per chunk: whole units, as many as keep `held` within `budget` (one unit at least), at most all."""
        per_unit = self.held(self.unit)
        units = max(1, budget // per_unit) if per_unit else 1
        return min(self.rows, units * self.unit)

    def held_bytes(self, chunk_bytes: int) -> int:
        """What the plan counts for this step: `held` of one chunk."""
        return self.held(self.chunk_rows(self.budget(chunk_bytes))) if self.rows else 0

    def converter(self, rows: int) -> Converter:
        """Chunks of at most `rows` rows de-quantised with a reused permutation buffer."""
        import numpy as np

        scratch = np.empty(rows * self.cols, np.float32) if self.heads else None
        kind, cols, dtype, unit, in_row, shift = self.kind, self.cols, self.dtype, self.unit, self.in_row, self.shift

        def convert(k: int, first: int, raw: Any, whole: Sequence[Any]) -> tuple[Any, int, float]:
            data = np.frombuffer(raw, dtype=np.uint8)
            heads = len(raw) // in_row // unit if self.heads else 0
            return dequantized_rows(data, kind, cols, heads, dtype, scratch, shift), 0, 0.0

        return convert


def offer_rows(op: Function, group: Any, ahead: tuple[Any, ...] = ()) -> DequantJob | None:
    """The row-wise de-quantisation `group` is (`op`: its `dequantize_gguf` Function alone), or None."""
    if ahead or not isinstance(op, Function) or op.fn != DEQUANTIZE_GGUF_FN or len(group.inputs) != 1:
        return None
    params = dict(op.params)
    source = group.inputs[0]
    outputs = tuple(group.outputs)
    count = len(outputs)
    if count > 1:  # the experts' byte ranges of the stacked tensor
        each = source.nbytes // count
        shape = (*tuple(source.shape)[1:],)
        inputs = tuple(replace(source, shape=shape, begin=source.begin + k * each, end=source.begin + (k + 1) * each)
                       for k in range(count))
    else:
        inputs = (source,)
    return DequantJob(inputs, outputs, params["kind"], params["dtype"], int(params.get("heads", 0)), float(params.get("shift", 0.0)))


def dequantize_gguf(tensor: Any, *, kind: str, shape: tuple[int, ...], dtype: str, heads: int = 0, experts: int = 1,
              shift: float = 0.0) -> Any:
    """`dequantize_gguf` on a whole torch tensor (verification, or a group with other ops): the engine's numpy conversion
    over the whole tensor. Returns one torch tensor, or a list of one per expert of a stacked tensor (`experts` > 1)."""
    import numpy as np
    import torch

    shape = tuple(shape)
    raw = tensor.detach().contiguous().cpu()
    data = raw.view(torch.uint8).numpy().reshape(-1) if raw.numel() else np.empty(0, np.uint8)
    one, _, cols = _split(shape, experts)
    per = data.size // experts
    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    outs = []
    for e in range(experts):
        part = dequantized_rows(data[e * per:(e + 1) * per], kind, cols, heads, dtype, shift=shift)
        outs.append(torch.from_numpy(part.copy()).view(torch_dtype).reshape(one))
    return outs if experts > 1 else outs[0]


dequantize_gguf.rows = offer_rows  # type: ignore[attr-defined]  # the row job `Function.rows` finds (mapper.row_jobs)


__all__ = ["DequantJob", "DEQUANTIZE_GGUF_FN", "OUTPUT_DTYPES", "block_of", "dequantizable", "dequantized_rows", "dequantize_gguf", "dequantize_gguf_function",
           "infer_dequantize_gguf", "offer_rows", "stored_row_bytes"]

"""compressed-tensors weights (vLLM / llm-compressor) back to bf16, and the `decompress` preset for every packed format.

Formats (`quantization_config.format`, or each config group's), computed as the library's own compressors'
`decompress()` do, bit for bit:

- `pack-quantized`: `X.weight_packed` int32, `bits`-wide signed values packed densely (value i of a row at bit
  i*bits of the row's little-endian words, stored plus 2**(bits-1)); asymmetric groups / channels add
  `X.weight_zero_point`, packed the same way along the output dim. `X.weight_shape` holds the true shape.
- `naive-quantized` / `int-quantized`: `X.weight` int8; `float-quantized`: `X.weight` float8 (per tensor, channel,
  group or block). Scales `X.weight_scale` (and zero points, unpacked) beside.
- `nvfp4-pack-quantized`: `X.weight_packed` uint8, two e2m1 values a byte (low nibble first), an FP8 scale per
  16 values and a float32 `X.weight_global_scale`.

Arithmetic: the library computes `(q - zero_point) * scale` in the scale's dtype (each product of two values of at
most 8 significant bits is exact in float32, so one float32 product rounded to the scale's dtype is the same), then
the result is cast to the output dtype. NVFP4 divides the scale by the global scale in float32 first, multiplies in
float32 and rounds to bf16.

The kernels work with numpy on a few rows at a time (`PIECE` values of scratch); stored by output rows, a weight
is a row job (`mapper.row_jobs`): the engine reads a chunk of packed rows from disk, the scales beside it whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...catalog import TensorInfo
from ...errors import MapperError
from .quantized import PIECE, _out, _output_code
from .scaled_rows import ScaledRows

HERE = "workbench.mapper.presets.compressed"
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by the low three bits
NVFP4_GROUP = 16
# The kernel's scratch beside the chunk: per PIECE values, unpacked bytes (1), float32 values (4), expanded scales
# and zero points (4 + 4, plus np.repeat's uncut copy) and the rounded piece (<= 4); bits other than 4 and 8 unpack
# through a bit stream (bits bytes a value).
SCRATCH = 32 * PIECE


# -- numpy at the edges -----------------------------------------------------------------------------------
def _np_dtype(code: str) -> Any:
    import ml_dtypes
    import numpy as np

    table = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
             "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I8": np.int8, "U8": np.uint8,
             "I16": np.int16, "I32": np.int32, "I64": np.int64, "U32": np.uint32}
    if code not in table:
        raise MapperError(f"Cannot decode a {code} tensor here: packed formats use {', '.join(table)}.")
    return table[code]


def _numpy(tensor: Any) -> tuple[Any, bool]:
    """(numpy array over the same memory, whether it was a torch tensor)."""
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return tensor, False
    import torch

    from ...dtypes import from_torch

    code = from_torch(tensor.dtype)
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.view(_np_dtype(code)).reshape(tuple(tensor.shape)), True


def unpack_bits(words: Any, bits: int, count: int) -> Any:
    """Unsigned `bits`-wide values packed densely in the little-endian words of each row of `words` (any integer
    dtype, rows in dim 0): value i of a row is bits [i*bits, (i+1)*bits) of the row's bit stream -> uint8 [rows, count]."""
    import numpy as np

    raw = np.ascontiguousarray(words).reshape(words.shape[0], -1).view(np.uint8)
    if bits == 8:
        return raw[:, :count]
    if bits == 4:
        out = np.empty((raw.shape[0], raw.shape[1] * 2), np.uint8)
        np.bitwise_and(raw, 0x0F, out=out[:, 0::2])
        np.right_shift(raw, 4, out=out[:, 1::2])
        return out[:, :count]
    stream = np.unpackbits(raw, axis=1, bitorder="little")[:, : count * bits].reshape(raw.shape[0], count, bits)
    return (stream << np.arange(bits, dtype=np.uint8)).sum(axis=2, dtype=np.uint16).astype(np.uint8)


def _expand(scale: Any, rows: slice, cols: int, strategy: str, group: int | None, block: Sequence[int] | None) -> Any:
    """The scale (or zero point) of every element of rows `rows` ([n, cols] or broadcastable to it)."""
    import numpy as np

    if strategy in ("group", "tensor_group"):
        return np.repeat(scale[rows], group, axis=1)[:, :cols]
    if strategy == "channel":
        return scale[rows].reshape(-1, 1)
    if strategy == "block":
        b0, b1 = block  # type: ignore[misc]
        r = np.arange(rows.start, rows.stop) // b0
        return np.repeat(scale[r], b1, axis=1)[:, :cols]
    return scale.reshape(-1)[:1].reshape(1, 1)


# -- the kernel --------------------------------------------------------------------------------------------
def _parts(tensors: Sequence[Any], roles: Sequence[str]) -> dict[str, Any]:
    if len(tensors) != len(roles):
        raise MapperError(f"Cannot decompress: got {len(tensors)} tensors for the roles {list(roles)}.")
    return dict(zip(roles, tensors, strict=True))


class _Decoder:
    """Dequantises rows of one compressed-tensors weight (scales and zero points decoded once)."""

    def __init__(self, parts: dict[str, Any], *, format: str, bits: int, strategy: str, group_size: int | None,
                 symmetric: bool, block: Sequence[int] | None, shape: Sequence[int], scale_code: str, dtype: str,
                 sparse: str = "") -> None:
        import numpy as np

        self.format, self.bits, self.strategy, self.group = format, bits, strategy, group_size
        self.block, self.shape, self.code = block, tuple(shape), dtype
        self.bitmask = parts.get("bitmask") if sparse else None
        if sparse and format == "dense":
            self.scale_code, self.zero, self.global_scale = dtype, None, None
            return
        if sparse:  # the library holds an int8 / float8 weight's scale as float16 and multiplies in float16
            scale_code = "F16"
            self.scale = np.asarray(parts["scale"]).astype(np.float16).astype(np.float32)
        else:
            self.scale = np.asarray(parts["scale"]).astype(np.float32)
        if len(self.shape) == 3:  # stacked experts: their rows one after another, each row's scales as in 2-D
            self.scale = self.scale.reshape(-1, self.scale.shape[-1])
        if self.scale.ndim == 1 and strategy in ("group", "tensor_group", "channel", "block"):
            self.scale = self.scale.reshape(-1, 1)
        self.scale_code = scale_code
        self.zero = None
        zero = parts.get("zero_point")
        if zero is not None and not symmetric:
            zero = np.asarray(zero)
            if format == "pack-quantized" and strategy in ("group", "channel"):
                experts = zero.reshape(-1, *zero.shape[-2:])  # packed along the output dim, each expert on its own
                unpacked = np.concatenate([unpack_bits(np.ascontiguousarray(z.T), bits, self.shape[-2]).T for z in experts])
                zero = unpacked.astype(np.int16) - (1 << (bits - 1))
            elif len(self.shape) == 3:
                zero = zero.reshape(-1, zero.shape[-1])
            self.zero = zero.astype(np.float32)
            if self.zero.ndim == 1 and strategy != "tensor":
                self.zero = self.zero.reshape(-1, 1)
        self.global_scale = None
        if format == "nvfp4-pack-quantized":
            gs = parts.get("global_scale")
            if gs is None:
                raise MapperError("Cannot decompress an NVFP4 weight without its weight_global_scale.")
            self.global_scale = np.asarray(gs).astype(np.float32)

    def rows(self, stored: Any, first: int) -> Any:
        """Output rows [first, first + len(stored)) from the stored rows `stored` (numpy, as on disk), converted
        `PIECE` values at a time so that the float32 scratch stays small whatever the chunk."""
        import numpy as np

        n, cols = stored.shape[0], self.shape[-1]
        out = np.empty((n, cols), _np_dtype(self.code))
        step = max(1, PIECE // max(1, cols))
        for r0 in range(0, n, step):
            out[r0:r0 + step] = self._piece(stored[r0:r0 + step], first + r0)
        return out

    def _piece(self, stored: Any, first: int) -> Any:
        import numpy as np

        n, cols = stored.shape[0], self.shape[-1]
        rows = slice(first, first + n)
        if self.bitmask is not None:
            stored = _expand_24(stored, self.bitmask[first:first + n], cols)
            if self.format == "dense":
                return stored if stored.dtype == _np_dtype(self.code) else _round_twice(stored.astype(np.float32), "F32", self.code)
        if self.format == "pack-quantized":
            values = unpack_bits(stored, self.bits, cols).astype(np.float32)
            values -= float(1 << (self.bits - 1))
        elif self.format == "nvfp4-pack-quantized":
            return self._nvfp4(stored, rows)
        else:
            values = stored.astype(np.float32)
        if self.zero is not None:
            values -= _expand(self.zero, rows, cols, self.strategy, self.group, self.block)
        values *= _expand(self.scale, rows, cols, self.strategy, self.group, self.block)
        return _round_twice(values, self.scale_code, self.code)

    def _nvfp4(self, stored: Any, rows: slice) -> Any:
        import numpy as np

        cols = self.shape[-1]
        nibbles = unpack_bits(stored.view(np.uint8), 4, cols)
        magnitude = np.asarray(FP4_VALUES, np.float32)[nibbles & 0x07]
        values = np.where(nibbles & 0x08, -magnitude, magnitude).astype(np.float32)
        bf16 = _np_dtype("BF16")
        scale = self.scale.astype(bf16).astype(np.float32)  # the library holds the FP8 scale as bf16 (exact)
        if self.global_scale.ndim == 0:  # a 0-dim global scale keeps the division in bf16
            scale = (scale / self.global_scale).astype(bf16).astype(np.float32)
            values *= _expand(scale, rows, cols, "group", NVFP4_GROUP, None)
            return _round_twice(values, "BF16", self.code)
        scale = scale / self.global_scale.reshape(-1)[0]  # float32: a bf16 tensor over a float32 one promotes
        values *= _expand(scale, rows, cols, "group", NVFP4_GROUP, None)
        return _round_twice(values, "BF16", self.code)


def _expand_24(values: Any, bitmask: Any, cols: int) -> Any:
    """2:4 sparse rows back to dense: `values` [n, cols / 2] (the kept values of each row, in order) placed where the
    little-endian bits of `bitmask` [n, ceil(cols / 8)] are set, zeros elsewhere (the stored dtype kept)."""
    import numpy as np

    mask = np.unpackbits(np.ascontiguousarray(bitmask), axis=1, count=cols, bitorder="little").view(bool)
    kept = mask.sum(axis=1)
    if (kept != values.shape[1]).any():
        row = int(np.argmax(kept != values.shape[1]))
        raise MapperError(f"Cannot decompress a 2:4 sparse weight: row {row} of its bitmask sets {int(kept[row])} bits for "
                          f"{values.shape[1]} stored values. The checkpoint is inconsistent.")
    raw = np.ascontiguousarray(values).view(f"u{values.dtype.itemsize}")
    dense = np.zeros((values.shape[0], cols), raw.dtype)
    dense[mask] = raw.reshape(-1)
    return dense.view(values.dtype)


def _round_twice(values: Any, compute: str, code: str) -> Any:
    """`values` (float32) rounded to the library's compute dtype, then cast to the output dtype."""
    rounded = values.astype(_np_dtype(compute)) if compute != "F32" else values
    return rounded if compute == code else rounded.astype(_np_dtype(code))


def decompress_tensor(*tensors: Any, roles: Sequence[str], format: str, bits: int, strategy: str,
                      group_size: int | None = None, symmetric: bool = True, block: Sequence[int] | None = None,
                      shape: Sequence[int], dtype: str = "BF16", sparse: str = "") -> Any:
    """One compressed-tensors weight, its tensors given in `roles` order ('packed', 'scale', 'zero_point', 'shape',
    'global_scale', 'bitmask') -> the dense weight of `shape` in `dtype`, a few rows at a time. `sparse`:
    'sparse-24-bitmask' when 'packed' holds the kept half of each row of a 2:4 sparse weight."""

    code = _output_code(dtype)
    arrays = [_numpy(t) for t in tensors]
    torch_in = any(flag for _, flag in arrays)
    parts = _parts([a for a, _ in arrays], roles)
    _check_stored_shape(parts.get("shape"), shape)
    scale_code = _scale_code(tensors[list(roles).index("scale")]) if "scale" in roles else code
    decoder = _Decoder(parts, format=format, bits=bits, strategy=strategy, group_size=group_size, symmetric=symmetric,
                       block=block, shape=shape, scale_code=scale_code, dtype=code, sparse=sparse)
    stored = parts["packed"]
    return _out(decoder.rows(stored.reshape(-1, stored.shape[-1]), 0).reshape(tuple(shape)), code, torch_in)


def _check_stored_shape(stored: Any, shape: Sequence[int], name: str = "") -> None:
    """Refuse a `weight_shape` tensor that disagrees with the shape the packed tensor and its scales give."""
    import numpy as np

    if stored is None:
        return
    values = np.asarray(stored).reshape(-1)
    if values.size != len(shape) or tuple(int(v) for v in values) != tuple(shape):
        raise MapperError(f"Cannot decompress{f' {name!r}' if name else ''}: its weight_shape holds {values.tolist()}, but "
                          f"the packed tensor and scales say {list(shape)}. The checkpoint is inconsistent.",
                          tensor=name or None)


def _scale_code(tensor: Any) -> str:
    if hasattr(tensor, "dtype") and not hasattr(tensor, "__array_interface__"):
        from ...dtypes import from_torch

        code = from_torch(tensor.dtype)
    else:
        code = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(tensor.dtype), "F32")
    return code if code in ("BF16", "F16", "F32") else "F32"


def infer_decompress(*infos: TensorInfo, roles: Sequence[str], format: str, bits: int, strategy: str,
                     group_size: int | None = None, symmetric: bool = True, block: Sequence[int] | None = None,
                     shape: Sequence[int], dtype: str = "BF16", sparse: str = "") -> list:
    """Metadata of `decompress_tensor`: checks every part's dtype and shape against the weight's `shape`."""
    code = _output_code(dtype)
    parts = _parts(infos, roles)
    check_parts(parts, format=format, bits=bits, strategy=strategy, group_size=group_size, symmetric=symmetric,
                block=block, shape=tuple(shape), sparse=sparse)
    return [(code, tuple(shape))]


def check_parts(parts: dict[str, TensorInfo], *, format: str, bits: int, strategy: str, group_size: int | None,
                symmetric: bool, block: Sequence[int] | None, shape: tuple[int, ...], sparse: str = "") -> None:
    """Refuse parts whose dtype or shape does not fit the weight (a clear error naming the tensor)."""
    packed, scale = parts["packed"], parts.get("scale")
    *lead, rows, cols = shape
    if lead and (sparse or format == "nvfp4-pack-quantized" or strategy not in ("group", "channel")):
        raise MapperError(f"Cannot decompress {packed.name!r}: stacked experts {list(shape)} are read for group and channel "
                          f"scales of pack-quantized / int / float weights, not {sparse or format} with {strategy} scales. "
                          "Unstack the experts first (one 2-D weight each).", tensor=packed.name)
    lead = tuple(lead)

    def bad(info: TensorInfo, expected: str) -> MapperError:
        return MapperError(f"Cannot decompress {packed.name!r} ({sparse + ' + ' if sparse else ''}{format}, {bits} bits, "
                           f"{strategy}): {info.name!r} is {info.dtype} {list(info.shape)}, expected {expected}. The "
                           "checkpoint does not match its quantization_config.", tensor=info.name)

    if sparse:
        mask = parts.get("bitmask")
        if mask is None or mask.dtype not in ("U8", "I8") or tuple(mask.shape) != (rows, math.ceil(cols / 8)):
            raise bad(mask if mask is not None else packed, f"a U8 bitmask [{rows}, {math.ceil(cols / 8)}] beside it")
        allowed = ("BF16", "F16", "F32") if format == "dense" else ("I8", "F8_E4M3", "F8_E5M2")
        if packed.dtype not in allowed or tuple(packed.shape) != (rows, cols // 2) or cols % 4:
            raise bad(packed, f"{' / '.join(allowed)} [{rows}, {cols // 2}] (half of each row's values, 2:4)")
        if format == "dense":
            return
    if scale is None:
        raise MapperError(f"Cannot decompress {packed.name!r} ({format}): its weight_scale tensor is missing. The "
                          "checkpoint is incomplete.", tensor=packed.name)
    if sparse:  # int8 / float8 values checked above
        pass
    elif format == "pack-quantized":
        words = math.ceil(cols * bits / 32)
        if packed.dtype != "I32" or tuple(packed.shape) != (*lead, rows, words):
            raise bad(packed, f"I32 {[*lead, rows, words]}")
    elif format == "nvfp4-pack-quantized":
        if packed.dtype != "U8" or tuple(packed.shape) != (rows, cols // 2):
            raise bad(packed, f"U8 [{rows}, {cols // 2}]")
    elif packed.dtype not in ("I8", "F8_E4M3", "F8_E5M2", "U8") or tuple(packed.shape) != tuple(shape):
        raise bad(packed, f"int8 / float8 {list(shape)}")
    group = NVFP4_GROUP if format == "nvfp4-pack-quantized" else group_size
    if strategy in ("group", "tensor_group"):
        if not group or cols % group:
            raise bad(packed, f"columns divisible by the group size {group}")
        grid: tuple[int, ...] = (rows, cols // group)
    elif strategy == "channel":
        grid = (rows, 1)
    elif strategy == "block" and block:
        grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    else:
        grid = (1,)
    grid = (*lead, *grid)
    if math.prod(scale.shape) != math.prod(grid) or (strategy != "tensor" and tuple(scale.shape) not in (grid, grid[:-1])):
        raise bad(scale, f"a scale grid {list(grid)}")
    zero = parts.get("zero_point")
    if not symmetric and format == "pack-quantized" and strategy in ("group", "channel"):
        if zero is None:
            raise MapperError(f"Cannot decompress {packed.name!r}: it is asymmetric ({format}) but has no weight_zero_point "
                              "beside it. The checkpoint is incomplete.", tensor=packed.name)
        expected = (*lead, math.ceil(rows * bits / 32), grid[-1])
        if zero.dtype != "I32" or tuple(zero.shape) != expected:
            raise bad(zero, f"I32 {list(expected)} (zero points packed along the rows)")
    elif zero is not None and not symmetric and math.prod(zero.shape) != math.prod(grid):
        raise bad(zero, f"a zero-point grid {list(grid)}")
    if format == "nvfp4-pack-quantized" and parts.get("global_scale") is None:
        raise MapperError(f"Cannot decompress {packed.name!r}: NVFP4 needs its weight_global_scale, and it is missing.",
                          tensor=packed.name)


# -- row job: a few output rows at a time, straight from the packed bytes ----------------------------------
class PackedRows(ScaledRows):
    """The row job of `decompress_tensor` (`mapper.row_jobs`): the packed (or int8 / float8) weight read a chunk of
    rows at a time, its scales, zero points and global scale read whole beside it."""

    library_detail = "ml_dtypes: packed weights dequantised by rows"

    def __init__(self, infos: dict[str, TensorInfo], output: TensorInfo, kwargs: dict[str, Any]) -> None:
        super().__init__(infos["packed"], output, tuple(infos[r] for r in kwargs["roles"] if r != "packed"),
                         kwargs.get("dtype", "BF16"))  # weight_shape read whole too: checked
        self.kwargs, self.parts = kwargs, infos

    @property
    def rows(self) -> int:
        """Rows of the weight; of stacked experts, all experts' rows one after another."""
        return math.prod(self.inputs[0].shape[:-1])

    def scratch(self, rows: int) -> int:
        """The parts' float32 copies (zero points unpacked) and the kernel's pieces."""
        decoded = sum(4 * math.prod(t.shape) for t in self.extra if t is not self.parts.get("bitmask"))
        if self.kwargs["format"] == "pack-quantized" and "zero_point" in self.kwargs["roles"]:
            decoded += 4 * math.prod(self.parts["scale"].shape)  # unpacked zero points, one a scale
        return decoded + SCRATCH

    def converter(self, rows: int) -> Any:
        import numpy as np

        packed, kwargs = self.inputs[0], self.kwargs
        roles = [r for r in kwargs["roles"] if r != "packed"]
        stored_dtype = _np_dtype(packed.dtype)
        decoder: list[_Decoder] = []

        def convert(k: int, first: int, raw: Any, whole: Any) -> tuple[Any, int, float]:
            if not decoder:
                parts = {role: np.frombuffer(buf, _np_dtype(info.dtype)).reshape(info.shape)
                         for role, buf, info in zip(roles, whole, self.extra, strict=True)}
                _check_stored_shape(parts.get("shape"), kwargs["shape"], packed.name)
                decoder.append(_Decoder(parts, format=kwargs["format"], bits=kwargs["bits"], strategy=kwargs["strategy"],
                                        group_size=kwargs.get("group_size"), symmetric=kwargs.get("symmetric", True),
                                        block=kwargs.get("block"), shape=kwargs["shape"],
                                        scale_code=_code_of(self.parts["scale"].dtype) if "scale" in self.parts else
                                        self.code, dtype=self.code, sparse=kwargs.get("sparse", "")))
            stored = np.frombuffer(raw, stored_dtype).reshape(-1, packed.shape[-1])
            out = decoder[0].rows(stored, first)
            return np.ascontiguousarray(out).reshape(-1).view(np.uint8), 0, 0.0

        return convert


def _code_of(code: str) -> str:
    return code if code in ("BF16", "F16", "F32") else "F32"


def _packed_rows(op: Any, group: Any, ahead: tuple[Any, ...] = ()) -> PackedRows | None:
    """The row job of a decompress group (one weight and its parts), None for any other."""
    if ahead or len(group.outputs) != 1:
        return None
    infos = {info.name: info for info in group.inputs}
    kwargs = op.kwargs
    roles = kwargs.get("roles", ())
    if len(roles) != len(op.inputs) or any(name not in infos for name in op.inputs):
        return None
    parts = {role: infos[name] for role, name in zip(roles, op.inputs, strict=True)}
    if len(parts["packed"].shape) not in (2, 3) or parts["packed"].shape[0] < 1:
        return None
    return PackedRows(parts, group.outputs[0], kwargs)


decompress_tensor.rows = _packed_rows  # type: ignore[attr-defined]  # the row job `Function.rows` finds


__all__ = ["PackedRows", "check_parts", "decompress_tensor", "infer_decompress", "unpack_bits"]

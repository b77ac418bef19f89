"""GPTQ and AWQ weights back to dense ones: `qweight` / `qzeros` / `scales` (/ `g_idx`) -> `X.weight` [out, in].

GPTQ (AutoGPTQ, GPTQModel, optimum): `qweight` int32 [in * bits / 32, out], each word holding 32 / bits input rows of
one output column, row i at bit (i mod 32/bits) * bits; `qzeros` int32 [groups, out * bits / 32] packed the same way
along the output columns; `scales` [groups, out]; `g_idx` int32 [in], the group of each input row (i // group_size
unless `desc_act` reordered them). Checkpoints in the original format (`checkpoint_format: gptq`, the default) store
each zero point minus one: the value used is stored + 1; `gptq_v2` stores it as is. Read as one little-endian bit
stream per column (qweight) or row (qzeros), every width is the same layout: with 3 bits, 32 values fill 3 words and
the 11th and 22nd values cross a word boundary (AutoGPTQ's `pack`).
  w[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])

AWQ GEMM (AutoAWQ, `version: gemm`): `qweight` int32 [in, out * bits / 32] packed along the output columns, the eight
4-bit values of a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (value j of the word's output columns sits at nibble
AWQ_ORDER.index(j)); `qzeros` [groups, out * bits / 32] likewise; `scales` [groups, out]; groups of consecutive rows.
  w[o, i] = scales[i // group, o] * (q[i, o] - zero[i // group, o])

AWQ GEMV (`version: gemv`, AutoAWQ's `WQLinear_GEMV`): by output rows, `qweight` [out, in * bits / 32] packed along the
input dim in natural order, `qzeros` [out, w] one per group likewise, `scales` [out, w * 32 / bits] (both padded to the
kernel's width): a row job a chunk of rows at a time (`GemvRows`). Marlin (`checkpoint_format: marlin`, AWQ `marlin`)
and AWQ `gemv_fast` are GPU kernels' tile permutations that no library here turns back into weights on CPU: refused
(`packing_refusal`), as there is no reference to check a dequantisation against.

As the reference dequantisers do (GPTQModel's `dequantize_weight`, compressed-tensors' AutoAWQ converter followed by
its pack-quantized decompression), the difference of two integers is multiplied by the scale in the scale's dtype;
the result is then cast to the output dtype. Packed along the input dim, a weight cannot be read by output rows
from disk: a step holds one linear's packed tensors and its dense output (the plan counts both; `GptqRows` runs it
with numpy alone), and the kernel works a few output rows at a time, so its scratch stays small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...catalog import TensorInfo
from ...errors import MapperError
from .compressed import SCRATCH, _np_dtype, _numpy, _round_twice, _scale_code, unpack_bits
from .packed import PackedModule, gptq_shape
from .quantized import PIECE, _out, _output_code
from .scaled_rows import ScaledRows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds value AWQ_ORDER[k] of its 8 output columns
BITS = (2, 3, 4, 8)


def _unpack_words(words: Any, bits: int) -> Any:
    """int32 words -> their 32/bits unsigned fields, lowest first: shape [..., 32/bits] (uint8)."""
    import numpy as np

    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    return ((words.astype(np.uint32)[..., None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8)


def dequantize_gptq_tensor(*tensors: Any, roles: Sequence[str], method: str, bits: int, group_size: int | None,
                           symmetric: bool = True, variant: str = "gptq", shape: Sequence[int], dtype: str = "BF16",
                           name: str = "") -> Any:
    """One GPTQ / AWQ linear (its tensors in `roles` order: 'packed' = qweight, 'zero_point' = qzeros, 'scale' =
    scales, 'g_idx') -> the dense weight [out, in] in `dtype`, a few output rows at a time. `name`: the g_idx
    tensor's, for errors."""
    import numpy as np

    code = _output_code(dtype)
    arrays = [_numpy(t) for t in tensors]
    torch_in = any(flag for _, flag in arrays)
    parts = dict(zip(roles, (a for a, _ in arrays), strict=True))
    out_features, in_features = shape
    scale_code = _scale_code(tensors[list(roles).index("scale")])
    if method == "awq" and variant == "gemv":
        gemv = _Gemv(parts, bits=bits, group_size=group_size, shape=shape, scale_code=scale_code, dtype=code)
        return _out(gemv.rows(parts["packed"].view(np.int32), 0), code, torch_in)
    scales = parts["scale"].astype(np.float32)
    per = 32 // bits
    qweight = parts["packed"].view(np.int32)
    qzeros = parts.get("zero_point")
    group = group_size or in_features
    if method == "gptq":
        g_idx = parts["g_idx"].astype(np.int64) if "g_idx" in parts else np.arange(in_features) // group
        if g_idx.shape != (in_features,) or (g_idx.size and (g_idx.min() < 0 or g_idx.max() >= scales.shape[0])):
            raise MapperError(f"Cannot dequantise a GPTQ weight: its g_idx {name or ''} names groups outside "
                              f"0..{scales.shape[0] - 1} (the scales' rows). The checkpoint is inconsistent.",
                              tensor=name or None)
    else:
        g_idx = np.arange(in_features) // group
    out = np.empty((out_features, in_features), _np_dtype(code))
    step = max(32, (PIECE // max(1, in_features)) // 32 * 32)  # 32 columns: whole words of zero points at any bits
    for o0 in range(0, out_features, step):
        o1 = min(o0 + step, out_features)
        if method == "gptq":  # each column's words one little-endian bit stream down the input rows (3 bits: across words)
            q = unpack_bits(np.ascontiguousarray(qweight[:, o0:o1].T), bits, in_features).T  # [in, n]
            zeros = _zeros(qzeros, bits, o0, o1, scales.shape[0], symmetric)
            if variant != "gptq_v2":
                zeros = zeros + 1
        else:
            w0, w1 = o0 // per, math.ceil(o1 / per)
            q = _awq_columns(qweight[:, w0:w1], bits)[:, o0 - w0 * per:o1 - w0 * per]
            zeros = (_awq_columns(qzeros[:, w0:w1], bits)[:, o0 - w0 * per:o1 - w0 * per].astype(np.float32)
                     if qzeros is not None else np.full((scales.shape[0], o1 - o0), float(1 << (bits - 1)), np.float32))
        values = q.astype(np.float32) - zeros[g_idx]
        values *= scales[g_idx, o0:o1]
        out[o0:o1] = _round_twice(values, scale_code, code).T
    return _out(out, code, torch_in)


class _Gemv:
    """Rows of one AWQ GEMV weight: `qweight` [out, in * bits / 32] packed along the input dim in natural order (value
    i of a row at bit i * bits of the row's words), `qzeros` [out, w] likewise (one per group), `scales` [out, >= groups]
    (AutoAWQ pads them with zeros to its kernel's width)."""

    def __init__(self, parts: dict[str, Any], *, bits: int, group_size: int | None, shape: Sequence[int], scale_code: str,
                 dtype: str) -> None:
        self.parts, self.bits, self.shape, self.scale_code, self.code = parts, bits, tuple(shape), scale_code, dtype
        self.group = group_size or shape[1]
        self.groups = math.ceil(shape[1] / self.group)

    def rows(self, stored: Any, first: int) -> Any:
        """Output rows [first, first + len(stored)) from the stored qweight rows `stored`, `PIECE` values at a time."""
        import numpy as np

        n, cols = stored.shape[0], self.shape[1]
        out = np.empty((n, cols), _np_dtype(self.code))
        step = max(1, PIECE // max(1, cols))
        for r0 in range(0, n, step):
            r1 = min(r0 + step, n)
            values = unpack_bits(stored[r0:r1], self.bits, cols).astype(np.float32)
            zero = self.parts.get("zero_point")
            if zero is None:
                zeros = np.full((r1 - r0, self.groups), float(1 << (self.bits - 1)), np.float32)
            else:
                zeros = unpack_bits(zero[first + r0:first + r1].view(np.int32), self.bits, self.groups).astype(np.float32)
            values -= np.repeat(zeros, self.group, axis=1)[:, :cols]
            values *= np.repeat(self.parts["scale"][first + r0:first + r1, :self.groups].astype(np.float32), self.group,
                                axis=1)[:, :cols]
            out[r0:r1] = _round_twice(values, self.scale_code, self.code)
        return out


class GptqRows(ScaledRows):
    """The row job of `dequantize_gptq_tensor` (`mapper.row_jobs`) with one "row", the whole linear: packed along its
    input dim, a weight cannot be cut into output rows on disk, but as a row job it is converted with numpy alone
    (no torch in the process), its qweight read raw, its scales, zeros and g_idx read whole beside it."""

    library_detail = "ml_dtypes: GPTQ / AWQ weights dequantised with numpy"

    def __init__(self, parts: dict[str, TensorInfo], output: TensorInfo, kwargs: dict[str, Any]) -> None:
        super().__init__(parts["packed"], output, tuple(parts[r] for r in kwargs["roles"] if r != "packed"),
                         kwargs.get("dtype", "BF16"))
        self.parts, self.kwargs = parts, kwargs

    rows = 1

    def chunk_rows(self, budget: int) -> int:
        return 1

    def scratch(self, rows: int) -> int:
        """float32 scales, int64 g_idx and the kernel's pieces."""
        return 4 * math.prod(self.parts["scale"].shape) + 8 * self.output.shape[1] + SCRATCH

    def converter(self, rows: int) -> Any:
        import numpy as np

        roles = [r for r in self.kwargs["roles"] if r != "packed"]
        kwargs = {k: v for k, v in self.kwargs.items() if k != "roles"}

        def convert(k: int, first: int, raw: Any, whole: Any) -> tuple[Any, int, float]:
            arrays = {role: np.frombuffer(buf, _np_dtype(info.dtype)).reshape(info.shape)
                      for role, buf, info in zip(roles, whole, self.extra, strict=True)}
            arrays["packed"] = np.frombuffer(raw, np.int32).reshape(self.inputs[0].shape)
            order = list(self.kwargs["roles"])
            out = dequantize_gptq_tensor(*(arrays[r] for r in order), roles=order, **kwargs,
                                         name=self.parts["g_idx"].name if "g_idx" in self.parts else "")
            return np.ascontiguousarray(out).reshape(-1).view(np.uint8), 0, 0.0

        return convert


class GemvRows(ScaledRows):
    """The row job of an AWQ GEMV weight: stored by output rows, its qweight is read a chunk of rows at a time, its
    scales and qzeros (a few values a row) read whole beside it."""

    library_detail = "ml_dtypes: AWQ GEMV weights dequantised by rows"

    def __init__(self, parts: dict[str, TensorInfo], output: TensorInfo, kwargs: dict[str, Any]) -> None:
        super().__init__(parts["packed"], output, tuple(parts[r] for r in kwargs["roles"] if r != "packed"),
                         kwargs.get("dtype", "BF16"))
        self.parts, self.kwargs = parts, kwargs

    def scratch(self, rows: int) -> int:
        return SCRATCH

    def converter(self, rows: int) -> Any:
        import numpy as np

        roles = [r for r in self.kwargs["roles"] if r != "packed"]
        cols = self.inputs[0].shape[1]
        scale_code = _code_of(self.parts["scale"].dtype)

        def convert(k: int, first: int, raw: Any, whole: Any) -> tuple[Any, int, float]:
            parts = {role: np.frombuffer(buf, _np_dtype(info.dtype)).reshape(info.shape)
                     for role, buf, info in zip(roles, whole, self.extra, strict=True)}
            gemv = _Gemv(parts, bits=self.kwargs["bits"], group_size=self.kwargs.get("group_size"),
                         shape=self.kwargs["shape"], scale_code=scale_code, dtype=self.code)
            out = gemv.rows(np.frombuffer(raw, np.int32).reshape(-1, cols), first)
            return np.ascontiguousarray(out).reshape(-1).view(np.uint8), 0, 0.0

        return convert


def _code_of(code: str) -> str:
    return code if code in ("BF16", "F16", "F32") else "F32"


def _gptq_rows(op: Any, group: Any, ahead: tuple[Any, ...] = ()) -> ScaledRows | None:
    """The row job of a GPTQ / AWQ group (one linear and its parts), None for any other."""
    if ahead or len(group.outputs) != 1:
        return None
    infos = {info.name: info for info in group.inputs}
    roles = op.kwargs.get("roles", ())
    if len(roles) != len(op.inputs) or any(name not in infos for name in op.inputs):
        return None
    parts = {role: infos[name] for role, name in zip(roles, op.inputs, strict=True)}
    if op.kwargs.get("method") == "awq" and op.kwargs.get("variant") == "gemv":
        return GemvRows(parts, group.outputs[0], op.kwargs)
    return GptqRows(parts, group.outputs[0], op.kwargs)


dequantize_gptq_tensor.rows = _gptq_rows  # type: ignore[attr-defined]  # the row job `Function.rows` finds


def _zeros(qzeros: Any, bits: int, o0: int, o1: int, groups: int, symmetric: bool) -> Any:
    """GPTQ zero points of output columns o0:o1 (o0 a multiple of 32) as stored ([groups, n] float32): each row of
    qzeros one little-endian bit stream, 32 columns in `bits` words."""
    import numpy as np

    if qzeros is None:  # symmetric without qzeros: the midpoint, as stored by the original format (minus one)
        return np.full((groups, o1 - o0), float((1 << (bits - 1)) - 1), np.float32)
    w0, w1 = o0 * bits // 32, math.ceil(o1 * bits / 32)
    return unpack_bits(np.ascontiguousarray(qzeros[:, w0:w1].view(np.int32)), bits, o1 - o0).astype(np.float32)


def _awq_columns(words: Any, bits: int) -> Any:
    """AWQ words [rows, w] -> their values in column order [rows, w * 32/bits] (uint8)."""
    import numpy as np

    fields = _unpack_words(words.view(np.int32), bits)  # [rows, w, per], field k holds column AWQ_ORDER[k]
    if bits == 4:
        ordered = np.empty_like(fields)
        ordered[..., list(AWQ_ORDER)] = fields
        fields = ordered
    return fields.reshape(words.shape[0], -1)


def infer_dequantize_gptq(*infos: TensorInfo, roles: Sequence[str], method: str, bits: int, group_size: int | None,
                          symmetric: bool = True, variant: str = "gptq", shape: Sequence[int], dtype: str = "BF16",
                          name: str = "") -> list:
    """Metadata of `dequantize_gptq_tensor`: checks every part's dtype and shape against the weight's `shape`."""
    code = _output_code(dtype)
    check_gptq(dict(zip(roles, infos, strict=True)), method=method, bits=bits, group_size=group_size, shape=tuple(shape),
               variant=variant)
    return [(code, tuple(shape))]


def check_gptq(parts: dict[str, TensorInfo], *, method: str, bits: int, group_size: int | None, shape: tuple[int, int],
               variant: str = "gptq") -> None:
    """Refuse parts whose dtype or shape does not fit a `method` weight of `shape` [out, in] (naming the tensor)."""
    out_features, in_features = shape
    packed = parts["packed"]
    groups = math.ceil(in_features / group_size) if group_size else 1
    gemv = method == "awq" and variant == "gemv"

    def bad(info: TensorInfo, expected: str) -> MapperError:
        return MapperError(f"Cannot dequantise {packed.name!r} ({method}, {bits} bits, group {group_size or 'channel'}): "
                           f"{info.name!r} is {info.dtype} {list(info.shape)}, expected {expected}. The checkpoint does not "
                           "match its quantization_config.", tensor=info.name)

    expected_q = ((in_features * bits // 32, out_features) if method == "gptq" else
                  (out_features, in_features * bits // 32) if gemv else (in_features, out_features * bits // 32))
    if packed.dtype not in ("I32", "U32") or tuple(packed.shape) != expected_q:
        raise bad(packed, f"I32 {list(expected_q)}")
    scale, zero = parts["scale"], parts.get("zero_point")
    if gemv:  # by output rows; AutoAWQ pads the group dim of both to its kernel's width
        if scale.dtype not in ("F16", "BF16", "F32") or len(scale.shape) != 2 or scale.shape[0] != out_features \
                or scale.shape[1] < groups:
            raise bad(scale, f"a float grid [{out_features}, >= {groups}]")
        if zero is not None and (zero.dtype not in ("I32", "U32") or len(zero.shape) != 2 or zero.shape[0] != out_features
                                 or zero.shape[1] * 32 // bits < groups):
            raise bad(zero, f"I32 [{out_features}, >= {math.ceil(groups * bits / 32)}]")
    else:
        if scale.dtype not in ("F16", "BF16", "F32") or tuple(scale.shape) != (groups, out_features):
            raise bad(scale, f"a float grid {[groups, out_features]}")
        if zero is not None and (zero.dtype not in ("I32", "U32") or tuple(zero.shape) != (groups, out_features * bits // 32)):
            raise bad(zero, f"I32 {[groups, out_features * bits // 32]}")
    g_idx = parts.get("g_idx")
    if g_idx is not None and (g_idx.dtype not in ("I32", "I64") or tuple(g_idx.shape) != (in_features,)):
        raise bad(g_idx, f"I32 [{in_features}]")


# packings documented by a producer, but kept out: each is a GPU kernel's tile layout that no library here turns back
# into plain weights on CPU, so a dequantisation could not be checked against a reference
MARLIN = ("marlin", "marlin-24", "marlin_24", "gemv_fast", "gemv-fast")


def packing_refusal(module: PackedModule) -> str:
    """Why `module`'s packing is not dequantised here ('' when it is), with what to do instead."""
    if module.method == "gptq" and module.variant not in ("gptq", "gptq_v2"):
        if module.variant in MARLIN:
            return (f"GPTQ checkpoint_format {module.variant!r} is Marlin's GPU tile permutation; no CPU dequantiser "
                    "exists to check it against. Load the model in gptqmodel / vLLM and save it in the 'gptq' format.")
        return (f"GPTQ checkpoint_format {module.variant!r} is not one the workbench reads ('gptq', 'gptq_v2'). Save it "
                "with gptqmodel in the 'gptq' format first.")
    if module.method == "awq" and module.variant not in ("gemm", "gemv"):
        why = ("a GPU kernel's interleaved tile layout with no CPU dequantiser to check it against"
               if module.variant in MARLIN else "not one the workbench reads ('gemm', 'gemv')")
        return f"AWQ version {module.variant!r} is {why}. Save it with AutoAWQ as version 'gemm' first."
    if module.method == "awq" and module.bits != 4:
        return f"AWQ with {module.bits} bits; AutoAWQ's packings hold 4-bit values (bits 4)."
    return ""


def gptq_params(module: PackedModule, infos: dict[str, TensorInfo], code: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(roles, Function params) of a GPTQ / AWQ module, its parts checked against its config (metadata only)."""
    if module.bits not in BITS:
        raise MapperError(f"Cannot dequantise {module.module!r}: {module.format} with {module.bits} bits is not supported "
                          f"(bits {', '.join(map(str, BITS))} are). Convert it with its own library first.", tensor=module.module)
    refusal = packing_refusal(module)
    if refusal:
        raise MapperError(f"Cannot dequantise {module.module!r}: {refusal}", tensor=module.module)
    for role in ("packed", "scale"):
        if role not in module.parts:
            wanted = "qweight" if role == "packed" else "scales"
            raise MapperError(f"Cannot dequantise {module.module!r} ({module.format}): its {wanted} tensor is missing. The "
                              "checkpoint is incomplete.", tensor=module.module)
    if not module.symmetric and "zero_point" not in module.parts:
        raise MapperError(f"Cannot dequantise {module.module!r}: it is asymmetric ({module.format}) but has no qzeros beside "
                          "it. The checkpoint is incomplete.", tensor=module.module)
    shape = gptq_shape(module, infos)
    roles = tuple(r for r in ("packed", "scale", "zero_point", "g_idx") if r in module.parts
                  and (module.method == "gptq" or r != "g_idx"))
    check_gptq({r: infos[module.parts[r]] for r in roles}, method=module.method, bits=module.bits,
               group_size=module.group_size, shape=shape, variant=module.variant)
    params = {"roles": list(roles), "method": module.method, "bits": module.bits, "group_size": module.group_size,
              "symmetric": module.symmetric, "variant": module.variant, "shape": list(shape), "dtype": code}
    return roles, params


__all__ = ["AWQ_ORDER", "check_gptq", "dequantize_gptq_tensor", "gptq_params", "infer_dequantize_gptq"]

"""GPTQ and AWQ weights back to dense ones: `qweight` / `qzeros` / `scales` (/ `g_idx`) -> `X.weight` [out, in].

GPTQ (AutoGPTQ, GPTQModel, optimum): `qweight` int32 [in * bits / 32, out], each word holding 32 / bits input rows of
one output column, row i at bit (i mod 32/bits) * bits; `qzeros` int32 [groups, out * bits / 32] packed the same way
along the output columns; `scales` [groups, out]; `g_idx` int32 [in], the group of each input row (i // group_size
unless `desc_act` reordered them). Checkpoints in the original format (`checkpoint_format: gptq`, the default) store
each zero point minus one: the value used is stored + 1; `gptq_v2` stores it as is.
  w[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])

AWQ GEMM (AutoAWQ, `version: gemm`): `qweight` int32 [in, out * bits / 32] packed along the output columns, the eight
4-bit values of a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (value j of the word's output columns sits at nibble
AWQ_ORDER.index(j)); `qzeros` [groups, out * bits / 32] likewise; `scales` [groups, out]; groups of consecutive rows.
  w[o, i] = scales[i // group, o] * (q[i, o] - zero[i // group, o])

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
from .compressed import SCRATCH, _np_dtype, _numpy, _round_twice, _scale_code
from .packed import PackedModule, gptq_shape
from .quantized import PIECE, _out, _output_code
from .scaled_rows import ScaledRows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds value AWQ_ORDER[k] of its 8 output columns
BITS = (2, 4, 8)


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
    step = max(per, (PIECE // max(1, in_features)) // per * per)
    for o0 in range(0, out_features, step):
        o1 = min(o0 + step, out_features)
        if method == "gptq":
            q = _unpack_words(qweight[:, o0:o1], bits).transpose(0, 2, 1).reshape(-1, o1 - o0)[:in_features]  # [in, n]
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


def _gptq_rows(op: Any, group: Any, ahead: tuple[Any, ...] = ()) -> GptqRows | None:
    """The row job of a GPTQ / AWQ group (one linear and its parts), None for any other."""
    if ahead or len(group.outputs) != 1:
        return None
    infos = {info.name: info for info in group.inputs}
    roles = op.kwargs.get("roles", ())
    if len(roles) != len(op.inputs) or any(name not in infos for name in op.inputs):
        return None
    return GptqRows({role: infos[name] for role, name in zip(roles, op.inputs, strict=True)}, group.outputs[0], op.kwargs)


dequantize_gptq_tensor.rows = _gptq_rows  # type: ignore[attr-defined]  # the row job `Function.rows` finds


def _zeros(qzeros: Any, bits: int, o0: int, o1: int, groups: int, symmetric: bool) -> Any:
    """GPTQ zero points of output columns o0:o1 as stored ([groups, n] float32)."""
    import numpy as np

    if qzeros is None:  # symmetric without qzeros: the midpoint, as stored by the original format (minus one)
        return np.full((groups, o1 - o0), float((1 << (bits - 1)) - 1), np.float32)
    per = 32 // bits
    w0, w1 = o0 // per, math.ceil(o1 / per)
    fields = _unpack_words(qzeros[:, w0:w1].view(np.int32), bits).reshape(qzeros.shape[0], -1)
    return fields[:, o0 - w0 * per:o1 - w0 * per].astype(np.float32)


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
    check_gptq(dict(zip(roles, infos, strict=True)), method=method, bits=bits, group_size=group_size, shape=tuple(shape))
    return [(code, tuple(shape))]


def check_gptq(parts: dict[str, TensorInfo], *, method: str, bits: int, group_size: int | None, shape: tuple[int, int]) -> None:
    """Refuse parts whose dtype or shape does not fit a `method` weight of `shape` [out, in] (naming the tensor)."""
    out_features, in_features = shape
    per = 32 // bits
    packed = parts["packed"]
    groups = math.ceil(in_features / group_size) if group_size else 1

    def bad(info: TensorInfo, expected: str) -> MapperError:
        return MapperError(f"Cannot dequantise {packed.name!r} ({method}, {bits} bits, group {group_size or 'channel'}): "
                           f"{info.name!r} is {info.dtype} {list(info.shape)}, expected {expected}. The checkpoint does not "
                           "match its quantization_config.", tensor=info.name)

    expected_q = (in_features // per, out_features) if method == "gptq" else (in_features, out_features // per)
    if packed.dtype not in ("I32", "U32") or tuple(packed.shape) != expected_q:
        raise bad(packed, f"I32 {list(expected_q)}")
    scale = parts["scale"]
    if scale.dtype not in ("F16", "BF16", "F32") or tuple(scale.shape) != (groups, out_features):
        raise bad(scale, f"a float grid {[groups, out_features]}")
    zero = parts.get("zero_point")
    if zero is not None and (zero.dtype not in ("I32", "U32") or tuple(zero.shape) != (groups, out_features // per)):
        raise bad(zero, f"I32 {[groups, out_features // per]}")
    g_idx = parts.get("g_idx")
    if g_idx is not None and (g_idx.dtype not in ("I32", "I64") or tuple(g_idx.shape) != (in_features,)):
        raise bad(g_idx, f"I32 [{in_features}]")


def gptq_params(module: PackedModule, infos: dict[str, TensorInfo], code: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(roles, Function params) of a GPTQ / AWQ module, its parts checked against its config (metadata only)."""
    if module.bits not in BITS:
        raise MapperError(f"Cannot dequantise {module.module!r}: {module.format} with {module.bits} bits is not supported "
                          f"(bits {', '.join(map(str, BITS))} are). Convert it with its own library first.", tensor=module.module)
    if module.method == "awq" and (module.variant != "gemm" or module.bits != 4):
        raise MapperError(f"Cannot dequantise {module.module!r}: AWQ version {module.variant!r} with {module.bits} bits; the "
                          "workbench reads AWQ's GEMM packing (version 'gemm', 4 bits).", tensor=module.module)
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
               group_size=module.group_size, shape=shape)
    params = {"roles": list(roles), "method": module.method, "bits": module.bits, "group_size": module.group_size,
              "symmetric": module.symmetric, "variant": module.variant, "shape": list(shape), "dtype": code}
    return roles, params


__all__ = ["AWQ_ORDER", "check_gptq", "dequantize_gptq_tensor", "gptq_params", "infer_dequantize_gptq"]

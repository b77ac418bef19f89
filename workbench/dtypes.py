"""The dtype vocabulary: safetensors dtype codes, their sizes in bits, and their torch/numpy names.

Every layer of the package speaks safetensors codes ('BF16', 'F32', ...): they are what headers hold,
they are plain strings (no torch import needed) and they round-trip through JSON.
"""

from __future__ import annotations

from typing import Any

from .errors import WorkbenchError

# code -> bits per element. The reader accepts exactly these; tests check the list against the
# installed safetensors package so a new upstream dtype shows up as a failing test, not a silent gap.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "C64": 64,
}

FLOAT_CODES = frozenset({"F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4", "F6_E2M3", "F6_E3M2", "F16", "BF16", "F32", "F64"})

# Floating-point codes the engine writes as cast targets (torch converts into each). F4 and F6 have no
# converter; F8_E8M0 is an unsigned power-of-two scale format (no sign, no mantissa): not a weights dtype.
CAST_TARGETS: tuple[str, ...] = ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")

# Floating-point codes whose values the engine can read (and so cast); F4 and F6 it can only copy as bytes.
CAST_SOURCES = frozenset({*CAST_TARGETS, "F8_E8M0"})

# Codes no cast can produce (no torch converter writes them): a mapper may only copy such tensors as bytes.
UNPRODUCIBLE = frozenset({"F4", "F6_E2M3", "F6_E3M2"})

# torch attribute names; resolved lazily so that header-only work never imports torch.
_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "float4_e2m1fn_x2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
}

# Friendly spellings users type (CLI --dtype, Cast(dtype=...)).
_ALIASES: dict[str, str] = {
    "bf16": "BF16", "bfloat16": "BF16",
    "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
    "fp32": "F32", "f32": "F32", "float32": "F32", "float": "F32",
    "fp64": "F64", "f64": "F64", "float64": "F64", "double": "F64",
    "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32", "uint32": "U32",
    "int64": "I64", "uint64": "U64", "bool": "BOOL", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "fp8": "F8_E4M3",
}


def normalize_dtype(dtype: Any) -> str:
    """Return the safetensors code for a code, an alias ('bf16', 'float32') or a torch.dtype."""
    if isinstance(dtype, str):
        if dtype in DTYPE_BITS:
            return dtype
        key = dtype.lower().removeprefix("torch.")
        if key in _ALIASES:
            return _ALIASES[key]
        if dtype.upper() in DTYPE_BITS:
            return dtype.upper()
        raise WorkbenchError(
            f"Cannot use dtype {dtype!r}: it is not a known dtype. "
            f"Use a safetensors code ({', '.join(DTYPE_BITS)}) or a torch name such as 'bfloat16'."
        )
    name = str(dtype).removeprefix("torch.")
    for code, torch_name in _TORCH_NAMES.items():
        if torch_name == name:
            return code
    raise WorkbenchError(f"Cannot use dtype {dtype!r}: safetensors has no code for it.")


def dtype_bits(code: str) -> int:
    """Bits per element of a safetensors dtype code."""
    return DTYPE_BITS[code]


def nbytes_of(code: str, numel: int) -> int:
    """Bytes taken by `numel` elements of `code` (sub-byte dtypes pack, rounding up)."""
    return (numel * DTYPE_BITS[code] + 7) // 8


def to_torch(code: str):
    """The torch.dtype of a safetensors code (imports torch)."""
    import torch

    name = _TORCH_NAMES.get(code)
    if name is None or not hasattr(torch, name):
        raise WorkbenchError(f"Cannot load dtype {code} as a tensor: this torch ({torch.__version__}) has no such dtype.")
    return getattr(torch, name)


def numpy_dtype(code: str) -> Any:
    """The numpy dtype of a float code numpy reads without torch: F32, F16, BF16 and the FP8 codes (ml_dtypes')."""
    import numpy as np

    if code in ("BF16", "F8_E4M3", "F8_E5M2"):
        import ml_dtypes

        return np.dtype({"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}[code])
    return np.dtype({"F16": np.float16, "F32": np.float32}[code])


def from_torch(dtype) -> str:
    """The safetensors code of a torch.dtype."""
    return normalize_dtype(dtype)


def numpy_castable(src_dtype: str, out_dtype: str) -> bool:
    """True when the engine converts `src_dtype` to `out_dtype` with numpy alone (no torch import).

    Only float32 -> bfloat16, the commonest cast; a chunk holding a NaN still goes to torch.
    """
    return src_dtype == "F32" and out_dtype == "BF16"


def is_float(code: str) -> bool:
    """True for floating-point codes (the ones a dtype policy may cast)."""
    return code in FLOAT_CODES


_SHORT = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64", "F8_E4M3": "fp8"}


def _spellings(code: str) -> str:
    return f"{_SHORT[code]}/{code}" if code in _SHORT else code


def policy_dtype(dtype: Any) -> str:
    """The code of a dtype policy's target (`dtype=` / `--dtype`): a floating-point dtype the engine produces.

    A policy casts every floating-point weight; an integer, bool or complex target would silently turn the
    weights into 0/1/truncated values, and F4/F6 have no converter: those are refused before anything runs.
    """
    code = normalize_dtype(dtype)
    if code in CAST_TARGETS:
        return code
    from .errors import PlanError

    if code in FLOAT_CODES:
        why = (f"the engine cannot produce {code}" if code != "F8_E8M0"
               else "F8_E8M0 is an unsigned power-of-two scale format: weights would lose their sign and mantissa")
        fix = "Choose one of those"
    else:
        why = f"{code} is not a floating-point dtype: every weight would become an integer, 0/1 or garbage"
        fix = f"To cast one tensor (a mask, indices) to {code}, use M.Cast(name, {code!r}) in a mapper"
    spelled = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    named = spelled if spelled == code else f"{spelled} ({code})"
    accepted = ", ".join(_spellings(c) for c in CAST_TARGETS)
    raise PlanError(
        f"Cannot store the weights as {named}: {why}. A dtype policy casts floating-point weights to one of {accepted} "
        f"(integer and bool tensors are never cast by it). {fix}."
    )

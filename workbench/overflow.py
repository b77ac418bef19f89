"""Values a cast cannot represent: counting those that overflow to ±inf, saturate, turn to NaN or wrap.

A cast to a narrower dtype rounds most values, but values beyond its range are replaced: fp16 and
float8 e5m2 give ±inf, float8 e4m3 saturates to ±448, the fnuz float8 types give NaN, integers wrap.
Such a value is a replacement, not a rounding, whatever the target does with it. For a float target
it starts at the overflow threshold: the largest finite value plus half a step, from where rounding
to nearest leaves the range (fp16: 65520). For an integer target it is one past either end.

Counting costs one min/max reduction per chunk (of the output when it is a 16/32-bit float with ±inf,
else of the input); only a chunk that reaches a threshold (or holds a NaN) is counted element by element. Casts inside computed groups report to the `collect()` ledger that
is active around them, so the engine and verification count the same way on every path.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

from .dtypes import DTYPE_BITS, FLOAT_CODES

_F32_MAX = (2 - 2**-23) * 2.0**127
# float code -> (largest finite value, half the step between it and the next value up)
_FLOAT_RANGE: dict[str, tuple[float, float]] = {
    "F16": (65504.0, 16.0),
    "BF16": ((2 - 2**-7) * 2.0**127, 2.0**119),
    "F32": (_F32_MAX, 2.0**103),
    "F8_E4M3": (448.0, 16.0),
    "F8_E5M2": (57344.0, 4096.0),
    "F8_E4M3FNUZ": (240.0, 8.0),
    "F8_E5M2FNUZ": (57344.0, 4096.0),
}
_HAS_INF = frozenset({"F16", "BF16", "F32", "F64", "F8_E5M2"})
_INTS = {"I8", "I16", "I32", "I64"}
_UINTS = {"U8", "U16", "U32", "U64", "BOOL"}


def limits(code: str) -> tuple[float, float] | None:
    """(low, high): a value <= low or >= high does not fit `code`; None when every value fits or the notion
    does not apply (F64; bool, complex, F8_E8M0, F4, F6)."""
    if code in _FLOAT_RANGE:
        largest, half_step = _FLOAT_RANGE[code]
        return -(largest + half_step), largest + half_step
    bits = DTYPE_BITS.get(code, 0)
    if code in _INTS:
        return -(2 ** (bits - 1)) - 1, 2 ** (bits - 1)
    if code in _UINTS and code != "BOOL":
        return -1, 2**bits
    return None


def _value_range(code: str) -> tuple[float, float]:
    """The smallest and largest value a tensor of `code` can hold (floats: ±inf)."""
    if code in FLOAT_CODES:
        return -math.inf, math.inf
    bits = DTYPE_BITS.get(code, 0)
    if code in _INTS:
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if code == "BOOL":
        return 0, 1
    if code in _UINTS:
        return 0, 2**bits - 1
    return 0, 0  # complex: not counted


def may_overflow(src: str, out: str) -> bool:
    """True when casting `src` to `out` can meet values that do not fit (so the cast must count them)."""
    bounds = limits(out)
    if bounds is None or src == out:
        return False
    if src in FLOAT_CODES:
        if src in _FLOAT_RANGE:  # a narrower float: only its own finite range (and inf, when `out` has none) matters
            largest = _FLOAT_RANGE[src][0]
            return largest >= bounds[1] or out not in _HAS_INF
        return src == "F64" or src == "F8_E8M0" or out not in _HAS_INF
    low, high = _value_range(src)
    return low <= bounds[0] or high >= bounds[1]


def _counts_infinities(out: str) -> bool:
    """True when an infinite input is itself replaced by the cast (`out` has no inf: e4m3 saturates, fnuz gives NaN)."""
    return out not in _HAS_INF


def _clean_output(converted: Any) -> bool:
    """True when a cast's 16- or 32-bit float output holds no ±inf and no NaN: nothing overflowed into it. Reading
    the output is cheaper than reading the input (fp32 -> fp16: half the bytes)."""
    smallest, largest = (float(v) for v in converted.reshape(-1).aminmax())
    return -math.inf < smallest and largest < math.inf  # NaN fails both


def count_torch(tensor: Any, src: str, out: str, converted: Any = None) -> tuple[int, float]:
    """(values of `tensor`, a `src` tensor, that do not fit `out`; the largest magnitude among them, 0.0 if none).

    `converted`, the cast's result when there is one, lets a 16/32-bit float target with ±inf be screened on
    the output; the input is counted element by element only when the output holds an infinity or a NaN.
    """
    import torch

    bounds = limits(out)
    if bounds is None or tensor.numel() == 0:
        return 0, 0.0
    if converted is not None and out in ("F16", "BF16", "F32") and _clean_output(converted):
        return 0, 0.0
    low, high = bounds
    flat = tensor.reshape(-1)
    if src in FLOAT_CODES:
        if flat.dtype.itemsize == 1 or flat.dtype == torch.float64:  # float8 has no reductions; keep float64 exact
            flat = flat.to(torch.float64)
        elif flat.dtype != torch.float32:
            flat = flat.to(torch.float32)  # every float16/bfloat16 value and threshold is exact in float32
        smallest, largest = torch.aminmax(flat)
        if float(smallest) > low and float(largest) < high:  # NaN fails both: counted element by element
            return 0, 0.0
        out_of_range = (flat >= high) | (flat <= low)
        if not _counts_infinities(out):
            out_of_range &= torch.isfinite(flat)
        found = flat[out_of_range]
        return int(found.numel()), float(found.abs().max()) if found.numel() else 0.0
    if flat.dtype == torch.bool:
        return 0, 0.0
    out_of_range = torch.zeros_like(flat, dtype=torch.bool)
    src_low, src_high = _value_range(src)
    if high <= src_high:
        out_of_range |= flat >= int(high)
    if low >= src_low:
        out_of_range |= flat <= int(low)
    found = flat[out_of_range]
    return int(found.numel()), float(found.double().abs().max()) if found.numel() else 0.0


def replacement(code: str) -> str:
    """What a value too large for `code` becomes when cast to it (for messages)."""
    if code in _HAS_INF:
        return "±inf"
    if code in _FLOAT_RANGE:
        return f"±{_FLOAT_RANGE[code][0]:g} (saturated)" if code == "F8_E4M3" else "NaN"
    return "a wrapped-around integer"


def largest_finite(code: str) -> float:
    """The largest magnitude `code` holds (for messages)."""
    if code in _FLOAT_RANGE:
        return _FLOAT_RANGE[code][0]
    low, high = _value_range(code)
    return max(-low, high)


def describe(code: str, count: int, largest: float) -> str:
    """One phrase: how many values overflow `code`, the largest, and what they become."""
    return (f"{count} value{'s' if count != 1 else ''} overflow{'s' if count == 1 else ''} {code} (largest magnitude "
            f"{largest:g}; {code} holds at most {largest_finite(code):g}) and become{'s' if count == 1 else ''} "
            f"{replacement(code)}")


class OverflowCounts:
    """Per tensor name: [values that did not fit, the largest magnitude among them, the dtype cast to].
    Plain data, so ranks can send it as JSON."""

    def __init__(self, counts: dict[str, list] | None = None) -> None:
        self.counts: dict[str, list] = {} if counts is None else {k: list(v) for k, v in counts.items()}

    def add(self, name: str, count: int, largest: float, dtype: str = "") -> None:
        """Add `count` values of tensor `name` that did not fit `dtype`, the largest of magnitude `largest`."""
        if count:
            entry = self.counts.setdefault(name, [0, 0.0, dtype])
            entry[0] += count
            entry[1] = max(entry[1], largest)
            entry[2] = entry[2] or dtype

    def merge(self, other: OverflowCounts | dict) -> None:
        """Add another ledger's counts (another rank's, or a nested one)."""
        for name, entry in (other.counts if isinstance(other, OverflowCounts) else other).items():
            self.add(name, *entry)

    def __bool__(self) -> bool:
        return bool(self.counts)


_ACTIVE: contextvars.ContextVar[OverflowCounts | None] = contextvars.ContextVar("workbench_overflow", default=None)
UNNAMED = ""  # the ledger key of a cast that does not know its output's name (an op inside a computed group)


@contextlib.contextmanager
def collect() -> Iterator[OverflowCounts]:
    """A ledger that casts made through `cast()` report to while the block runs."""
    ledger = OverflowCounts()
    token = _ACTIVE.set(ledger)
    try:
        yield ledger
    finally:
        _ACTIVE.reset(token)


def attributed(found: OverflowCounts, outputs: list[str], label: str | None = None) -> dict[str, list]:
    """`found`'s counts by output name: a cast that did not know its output's name (an op inside a group)
    is the group's only output's, or else the group's (its label)."""
    named: dict[str, list] = {}
    for name, entry in found.counts.items():
        if name == UNNAMED:
            name = outputs[0] if len(outputs) == 1 else (label or outputs[0])
        if name in named:
            named[name] = [named[name][0] + entry[0], max(named[name][1], entry[1]), named[name][2] or entry[2]]
        else:
            named[name] = list(entry)
    return named


def cast(tensor: Any, code: str, name: str = UNNAMED) -> Any:
    """`tensor` converted to dtype `code`; values that do not fit are counted in the active ledger, if any."""
    from .dtypes import from_torch, to_torch

    ledger = _ACTIVE.get()
    if ledger is not None:
        src = from_torch(tensor.dtype)
        if may_overflow(src, code):
            converted = tensor.to(to_torch(code))
            ledger.add(name, *count_torch(tensor, src, code, converted), code)
            return converted
    return tensor.to(to_torch(code))


def report(count: int, largest: float, code: str, name: str = UNNAMED) -> None:
    """Count values a conversion outside `cast` (numpy) could not fit into `code`, in the active ledger, if any."""
    ledger = _ACTIVE.get()
    if ledger is not None and count:
        ledger.add(name, count, largest, code)


__all__ = ["OverflowCounts", "attributed", "cast", "collect", "count_torch", "describe", "largest_finite", "limits", "may_overflow", "replacement", "report"]

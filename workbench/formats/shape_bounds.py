"""Tensor shapes read from untrusted files: what a shape must satisfy before anything multiplies it.

The reference safetensors reader counts a tensor's elements and their bits in 64-bit integers and
refuses a shape whose count overflows, even when a later dimension is 0 (`[2**62, 2**62, 0]`): a file
holding such a shape is one other readers refuse. The workbench counts the non-zero dimensions, so
the order of the dimensions does not matter (the reference, multiplying left to right, lets a leading
0 hide the overflow of `[0, 2**62, 2**62]`; no real tensor has either shape). Every workbench reader (safetensors headers, torch
sizes and strides, DCP sizes, atorch shapes) applies the same rule, and does it before a size is
multiplied, compared or printed: a dimension of thousands of digits makes products Python cannot even
turn into text. Every dimension must also be below 2**63: torch sizes are signed 64-bit, and every
tensor the workbench catalogs is one it may load or convert (`[2**63, 0]` is a valid safetensors shape,
but no torch tensor has it).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..display import format_shape, format_value

LIMIT = 1 << 64  # element counts and bit counts are unsigned 64-bit in the reference reader
INDEX_LIMIT = 1 << 63  # torch sizes, strides and offsets are signed 64-bit


def shape_problem(shape: Iterable[object], bits: int = 8) -> str | None:
    """Why `shape` (of elements of `bits` bits) cannot be a tensor's, or None.

    Every dimension must be a non-negative integer below 2**63 (a torch size), the product of the non-zero dimensions must fit 64
    bits (so a zero elsewhere in the shape does not excuse an overflow), and so must the tensor's size
    in bits.
    """
    count = 1
    zero = not_torch = False
    for d in shape:
        if type(d) is not int or d < 0:
            return f"shape {format_shape(shape)} is not a list of non-negative integers"
        if d >= INDEX_LIMIT:
            not_torch = True
        if not d:
            zero = True
            continue
        count *= d
        if count >= LIMIT:
            return f"shape {format_shape(shape)} overflows 64 bits (its non-zero dimensions count more elements than a 64-bit size holds)"
    if not zero and count * bits >= LIMIT:
        return f"shape {format_shape(shape)} overflows 64 bits (its size in bits does not fit a 64-bit size)"
    if not_torch:
        return f"shape {format_shape(shape)} has a dimension of 2**63 or more, which no torch tensor can have (torch sizes are signed 64-bit)"
    return None


def index_problem(values: Iterable[object], what: str) -> str | None:
    """Why torch `values` (strides, an offset) cannot be signed 64-bit indices, or None."""
    for v in values:
        if type(v) is not int or not 0 <= v < INDEX_LIMIT:
            return f"{what} {format_value(v)} is not a 64-bit index"
    return None

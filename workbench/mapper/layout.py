"""Byte recipes: which input bytes, in which order, make up an output tensor.

When an operation only moves bytes (rename, reshape, concat/split/stack/unstack, block transposes),
each output is a concatenation of byte slices of the inputs. Tracing a concrete mapper over `Sym`
values (metadata plus slices) yields those recipes, so the engine can copy bytes without torch.
A recipe longer than `MAX_SLICES` slices per output is dropped (None): past that, computing with
tensors is cheaper than bookkeeping.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from ..dtypes import dtype_bits
from .groups import ByteSlice

MAX_SLICES = 4096

Slices = tuple[ByteSlice, ...]


@dataclass(slots=True)
class Sym:
    """A symbolic tensor: metadata, its bytes as slices of inputs (or None), and its element lineage.

    `elems_of` names the single input whose elements this tensor holds in order (possibly cast);
    `casts` counts the dtype conversions applied on the way (a chunked cast needs exactly one).
    """

    dtype: str
    shape: tuple[int, ...]
    slices: Slices | None
    elems_of: str | None = None
    casts: int = 0


def whole(name: str, dtype: str, shape: tuple[int, ...]) -> Sym:
    """The Sym of an input tensor: all of its own bytes."""
    nbytes = (math.prod(shape) * dtype_bits(dtype) + 7) // 8
    slices = (ByteSlice(name, 0, nbytes),) if nbytes else ()
    return Sym(dtype, shape, slices, name, 0)


def merge(slices: Sequence[ByteSlice]) -> Slices:
    """Coalesce neighbouring slices that continue each other in the same input."""
    out: list[ByteSlice] = []
    for piece in slices:
        if piece.end == piece.begin:
            continue
        if out and out[-1].source == piece.source and out[-1].end == piece.begin:
            out[-1] = ByteSlice(piece.source, out[-1].begin, piece.end)
        else:
            out.append(piece)
    return tuple(out)


class _Cursor:
    """Random access by byte offset into the virtual concatenation of a slice list."""

    __slots__ = ("slices", "starts")

    def __init__(self, slices: Slices) -> None:
        self.slices = slices
        starts, total = [], 0
        for piece in slices:
            starts.append(total)
            total += piece.length
        self.starts = starts

    def take(self, begin: int, end: int, out: list[ByteSlice]) -> None:
        index = bisect_right(self.starts, begin) - 1
        while begin < end:
            piece = self.slices[index]
            offset = begin - self.starts[index]
            length = min(end - begin, piece.length - offset)
            out.append(ByteSlice(piece.source, piece.begin + offset, piece.begin + offset + length))
            begin += length
            index += 1


def _byte_len(elements: int, bits: int) -> int | None:
    total = elements * bits
    return total // 8 if total % 8 == 0 else None


def _capped(pieces: list[ByteSlice]) -> Slices | None:
    merged = merge(pieces)
    return merged if len(merged) <= MAX_SLICES else None


def concat_slices(inputs: Sequence[Sym], dim: int, bits: int) -> Slices | None:
    """Slices of the concatenation of `inputs` along `dim` (shapes already checked)."""
    if any(sym.slices is None for sym in inputs):
        return None
    outer = math.prod(inputs[0].shape[:dim])
    if outer * len(inputs) > MAX_SLICES * 4:
        return None
    blocks = [_byte_len(math.prod(sym.shape[dim:]), bits) for sym in inputs]
    if any(block is None for block in blocks):
        return None
    cursors = [_Cursor(sym.slices) for sym in inputs]  # type: ignore[arg-type]
    pieces: list[ByteSlice] = []
    for row in range(outer):
        for cursor, block in zip(cursors, blocks, strict=False):
            cursor.take(row * block, (row + 1) * block, pieces)  # type: ignore[operator]
        if len(pieces) > MAX_SLICES * 4:
            return None
    return _capped(pieces)


def split_slices(source: Sym, dim: int, sizes: Sequence[int], bits: int) -> list[Slices | None]:
    """Slices of each part when `source` is split along `dim` into `sizes`."""
    if source.slices is None:
        return [None] * len(sizes)
    outer = math.prod(source.shape[:dim])
    inner = math.prod(source.shape[dim + 1:])
    row = _byte_len(source.shape[dim] * inner, bits)
    if row is None or outer > MAX_SLICES * 4:
        return [None] * len(sizes)
    cursor = _Cursor(source.slices)
    result: list[Slices | None] = []
    offset = 0
    for size in sizes:
        start, length = _byte_len(offset * inner, bits), _byte_len(size * inner, bits)
        offset += size
        if start is None or length is None:
            result.append(None)
            continue
        pieces: list[ByteSlice] = []
        for index in range(outer):
            cursor.take(index * row + start, index * row + start + length, pieces)
        result.append(_capped(pieces))
    return result


def transpose_slices(source: Sym, dim0: int, dim1: int, bits: int) -> Slices | None:
    """Slices after swapping two dims: a permutation of the contiguous blocks below the later dim.

    Only when the last dim stays in place, so each block is at least a whole row.
    """
    if source.slices is None:
        return None
    low, high = sorted((dim0, dim1))
    if low == high:
        return source.slices
    shape = source.shape
    order = list(range(len(shape)))
    order[low], order[high] = high, low
    moved = [dim for dim in order if shape[dim] != 1]
    if moved == sorted(moved):
        return source.slices  # only size-1 dims change place: the byte order is unchanged
    if high == len(shape) - 1:
        return None  # element-wise shuffle (e.g. a matrix transpose): arithmetic, not byte moving
    block = _byte_len(math.prod(shape[high + 1:]), bits)
    nblocks = math.prod(shape[: high + 1])
    if block is None or nblocks > MAX_SLICES * 4:
        return None
    import numpy as np

    order = np.arange(nblocks).reshape(shape[: high + 1]).swapaxes(low, high).reshape(-1)
    cursor = _Cursor(source.slices)
    pieces: list[ByteSlice] = []
    for index in order.tolist():
        cursor.take(index * block, (index + 1) * block, pieces)
    return _capped(pieces)

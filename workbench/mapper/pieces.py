"""Streamed pieces: a group whose one output is a stack (or concatenation) of computed pieces, made piece by piece.

Experts dequantised then stacked (`Sequential(dequantize_fp8, from_transformers)`) make one output of E x the
bytes of an expert. Computing it whole holds every input, every dequantised expert and the output at once. But
each dim-0 slab of such an output depends on its own inputs only: `Stack(xs, dim=0)`'s slab e is `xs[e]`;
`Concat(xs, dim=0)`'s slabs are those of its inputs in turn; `Concat(xs, dim=d > 0)` of inputs cut into the same
slabs is, slab by slab, the concatenation of theirs along d; so is a `Concat(xs, dim=d > 0)` of source tensors, or of
casts of them (a row block of the output is the concatenation of the same rows of each input, read as a byte range;
a block holds `ROW_BLOCK_BYTES` at most: inputs, casts and output rows); a `Cast` of such an output is the cast of each slab. `output_pieces(group)` finds that structure on the
group's op (metadata only: the op is walked over symbolic values, as binding infers) and returns `Pieces`: one
`Piece` per contiguous byte range of the output, each knowing the source tensors it reads and what it holds at
most. The engine computes a piece, writes it at its byte range and frees it; the planner counts the largest piece.
Any other shape of group returns None and is computed whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..catalog import TensorInfo
from ..dtypes import nbytes_of
from .evaluate import checked_compute, run
from .function import Function
from .ops import Cast, Concat, Identity, Rename, Stack

Meta = tuple[str, tuple[int, ...]]

ROW_BLOCK_BYTES = 16 << 20  # what one row block of a concatenation along dim > 0 of source rows holds, at most


class Value:
    """A value of the symbolic walk: a source tensor (`info`) or output `index` of `op` applied to `args`."""

    __slots__ = ("op", "args", "index", "meta", "info", "rows")

    def __init__(self, meta: Meta, op: Any = None, args: tuple[Value, ...] = (), index: int = 0,
                 info: TensorInfo | None = None, rows: tuple[int, int] | None = None) -> None:
        self.meta, self.op, self.args, self.index, self.info = meta, op, args, index, info
        self.rows = rows  # a source's dim-0 rows [begin, end) only (`meta` is theirs), or None: the whole source

    @property
    def nbytes(self) -> int:
        dtype, shape = self.meta
        count = 1
        for size in shape:
            count *= size
        return nbytes_of(dtype, count)


@dataclass(frozen=True)
class Piece:
    """`rows` consecutive dim-0 rows of the output: the whole of `value` (`unsqueeze`: a stacked one, given one
    leading row), or the concatenation along `dim` of the same rows of `parts`."""

    rows: int
    value: Value | None = None
    unsqueeze: bool = False
    dim: int = 0
    parts: tuple[Piece, ...] = ()

    def sources(self) -> dict[str, TensorInfo]:
        """The source tensors this piece reads (name -> info)."""
        found: dict[str, TensorInfo] = {}
        for value in self._values():
            _collect_sources(value, found)
        return found

    def held_bytes(self, out_row: int) -> int:
        """At most what computing this piece holds: its sources and every value computed from them (a stacked
        part is a view of one), plus the joined rows when parts are concatenated."""
        seen: dict[int, int] = {}
        for value in self._values():
            _collect_bytes(value, seen)
        return sum(seen.values()) + (self.rows * out_row if self.parts else 0)

    def _values(self) -> list[Value]:
        return [self.value] if self.value is not None else [v for part in self.parts for v in part._values()]

    def compute(self, read: Callable[..., Any]) -> Any:
        """The piece as a torch tensor of `rows` leading rows (sources read with `read(info)`, or `read(info, rows)`
        for dim-0 rows [begin, end) of one (`Pieces.row_blocks`); intermediates freed)."""
        if self.value is not None:
            tensor = _evaluate(self.value, read, {})
            return tensor.unsqueeze(0) if self.unsqueeze else tensor
        import torch

        return torch.cat([part.compute(read) for part in self.parts], dim=self.dim)


@dataclass(frozen=True)
class Pieces:
    """The output's pieces in order; `row_bytes`: bytes of one dim-0 row of the output."""

    output: TensorInfo
    pieces: tuple[Piece, ...]
    row_bytes: int
    row_blocks: bool = False  # some piece reads rows of a source, not a whole one: the engine reads them as byte ranges

    @property
    def held_bytes(self) -> int:
        """What the largest piece holds: the plan's count for the step."""
        return max(piece.held_bytes(self.row_bytes) for piece in self.pieces)


def _collect_sources(value: Value, found: dict[str, TensorInfo]) -> None:
    if value.info is not None:
        found[value.info.name] = value.info
    for arg in value.args:
        _collect_sources(arg, found)


def _collect_bytes(value: Value, seen: dict[int, int]) -> None:
    if id(value) in seen:
        return
    seen[id(value)] = value.nbytes
    for arg in value.args:
        _collect_bytes(arg, seen)


def _evaluate(value: Value, read: Callable[..., Any], cache: dict[int, list[Any]]) -> Any:
    if value.info is not None:
        return read(value.info) if value.rows is None else read(value.info, value.rows)
    results = cache.get(id(value.op))
    if results is None:
        args = [_evaluate(arg, read, cache) for arg in value.args]
        results = checked_compute(value.op, args)
        cache[id(value.op)] = results
    return results[value.index]


def _walk(group: Any) -> dict[str, Value]:
    """The group's op run over symbolic values: output name -> the Value that makes it. A `Function`'s inference
    depends on its callable, parameters and input metadata only, so the experts of a stack share one answer."""
    state: dict[str, Any] = {info.name: Value((info.dtype, tuple(info.shape)), info=info) for info in group.inputs}
    inferred: dict[Any, list[Meta]] = {}

    def leaf(op: Any, values: list[Value]) -> list[Value]:
        key = (op.fn, op.infer, op.params, tuple(value.meta for value in values)) if isinstance(op, Function) else None
        metas = inferred.get(key) if key is not None else None
        if metas is None:
            metas = op._infer([value.meta for value in values])
            if key is not None:
                inferred[key] = metas
        args = tuple(values)
        return [Value((dtype, tuple(shape)), op, args, k) for k, (dtype, shape) in enumerate(metas)]

    op = group.op
    after = getattr(op, "cast_after", None)  # a dtype policy's cast of some outputs (`planning.dtype_policy`)
    if after is not None:
        op, dtype, names = after
    run(op, state, leaf)
    if after is not None:
        for name in names:
            value = state.get(name)
            if value is not None:
                state[name] = Value((dtype, value.meta[1]), Cast(name, dtype), (value,))
    return state


def _cast_piece(piece: Piece, op: Cast) -> Piece:
    """`piece` followed by the elementwise `op` (its parts each cast when it is a concatenation)."""
    if piece.value is not None:
        inner = piece.value
        return Piece(piece.rows, value=Value((op.dtype, inner.meta[1]), op, (inner,)), unsqueeze=piece.unsqueeze)
    return Piece(piece.rows, dim=piece.dim, parts=tuple(_cast_piece(part, op) for part in piece.parts))


def _row_slicer(value: Value) -> Callable[[int, int], Value] | None:
    """A function giving dim-0 rows [begin, end) of `value` as a Value of their own, when `value` is a source tensor
    or an elementwise chain of one (casts, renames), else None."""
    op = value.op
    if op is None:
        info = value.info
        if info is None or not info.shape:
            return None
        dtype, shape = value.meta
        return lambda begin, end: Value((dtype, (end - begin,) + shape[1:]), info=info, rows=(begin, end))
    if isinstance(op, (Rename, Identity)):
        return _row_slicer(value.args[0])
    if isinstance(op, Cast):
        inner = _row_slicer(value.args[0])
        if inner is None:
            return None
        dtype, shape = value.meta

        def cast_rows(begin: int, end: int) -> Value:
            return Value((dtype, (end - begin,) + shape[1:]), op, (inner(begin, end),))

        return cast_rows
    return None


def _row_blocks(value: Value, dim: int) -> list[Piece] | None:
    """A concatenation along `dim` > 0 of source rows (or casts of them) cut into row blocks each holding at most
    ROW_BLOCK_BYTES (one row at least), each the concatenation of the same rows of every input; None when an input
    is anything else."""
    slicers = [_row_slicer(arg) for arg in value.args]
    if not slicers or any(slicer is None for slicer in slicers):
        return None
    dtype, shape = value.meta
    rows = shape[0]
    row_bytes = Value((dtype, (1,) + shape[1:])).nbytes
    one = Piece(1, dim=dim, parts=tuple(Piece(1, value=slicer(0, 1)) for slicer in slicers))  # type: ignore[misc]
    per = max(1, ROW_BLOCK_BYTES // max(one.held_bytes(row_bytes), 1))  # rows a block: what it holds, at most the budget
    return [Piece(min(per, rows - begin), dim=dim,
                  parts=tuple(Piece(min(per, rows - begin), value=slicer(begin, min(begin + per, rows)))  # type: ignore[misc]
                              for slicer in slicers))
            for begin in range(0, rows, per)]


def _pieces_of(value: Value) -> list[Piece] | None:
    """`value` cut into dim-0 pieces each computed on its own, or None when it is not such a stack/concatenation."""
    op = value.op
    if op is None:
        return None
    if isinstance(op, (Rename, Identity)):
        return _pieces_of(value.args[0])
    if isinstance(op, Cast):  # elementwise: each piece cast on its own
        inner = _pieces_of(value.args[0])
        return None if inner is None else [_cast_piece(piece, op) for piece in inner]
    shape = value.meta[1]
    if isinstance(op, Stack) and op.dim == 0:
        return [Piece(1, value=arg, unsqueeze=True) for arg in value.args]
    if isinstance(op, Concat) and len(shape) >= 1:
        dim = op.dim % len(shape)
        if dim == 0:
            out: list[Piece] = []
            for arg in value.args:
                out.extend(_pieces_of(arg) or [Piece(arg.meta[1][0], value=arg)])
            return out
        cut = [_pieces_of(arg) for arg in value.args]
        if any(pieces is None for pieces in cut):
            return _row_blocks(value, dim) if all(pieces is None for pieces in cut) else None
        rows = [[piece.rows for piece in pieces] for pieces in cut]  # type: ignore[union-attr]
        if any(r != rows[0] for r in rows[1:]):
            return None
        return [Piece(rows[0][k], dim=dim, parts=tuple(pieces[k] for pieces in cut))  # type: ignore[index]
                for k in range(len(rows[0]))]
    return None


def output_pieces(group: Any) -> Pieces | None:
    """The pieces of `group`'s one output when it is a stack/concatenation of computed pieces (see the module text)."""
    if group.recipe is not None or len(group.outputs) != 1 or not group.inputs:
        return None
    output = group.outputs[0]
    leaves = getattr(group.op, "leaves", None)  # a hand-made group may hold any object with `apply`
    if len(output.shape) < 1 or output.shape[0] < 2 or leaves is None or not any(isinstance(leaf, (Stack, Concat)) for leaf in leaves()):
        return None
    try:
        values = _walk(group)
    except Exception:  # noqa: BLE001 - any op the symbolic walk cannot take: computed whole, as before
        return None
    value = values.get(output.name)
    if value is None or tuple(value.meta[1]) != tuple(output.shape) or value.meta[0] != output.dtype:
        return None
    pieces = _pieces_of(value)
    if not pieces or len(pieces) < 2 or sum(piece.rows for piece in pieces) != output.shape[0]:
        return None
    blocks = any(v.rows is not None for piece in pieces for v in _leaves(piece))
    return Pieces(output, tuple(pieces), output.nbytes // output.shape[0], blocks)


def _leaves(piece: Piece) -> list[Value]:
    """The source Values a piece reads."""
    found: list[Value] = []

    def walk(value: Value) -> None:
        if value.info is not None:
            found.append(value)
        for arg in value.args:
            walk(arg)

    for value in piece._values():
        walk(value)
    return found


def row_range(info: TensorInfo, begin: int, end: int) -> TensorInfo:
    """Dim-0 rows [begin, end) of a source tensor raw in its file, as a tensor of their own at their byte range."""
    row = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
    return TensorInfo(info.name, info.dtype, (end - begin,) + tuple(info.shape[1:]), info.file, info.begin + begin * row,
                      info.begin + end * row)


def sources_by_piece(pieces: Pieces) -> list[Mapping[str, TensorInfo]]:
    """The source tensors each piece reads, in order."""
    return [piece.sources() for piece in pieces.pieces]


__all__ = ["Piece", "Pieces", "output_pieces", "row_range", "sources_by_piece"]

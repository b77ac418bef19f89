"""Parts of a step: one output tensor written by several ranks, each a contiguous byte range of it.

A stacked expert tensor of a frontier MoE (DeepSeek-V3's `gate_up_proj` of one layer: 15 GB) is larger than a
64th of the whole output, so ranks that own whole files (or whole tensors) cannot share the work evenly. Some steps
are made of independent units written one after another into their one output: a PIECES step's pieces (an expert
each), a ROWS step's row chunks, a copy's byte slices. `units(step)` lists the bytes of each such unit in order;
`part_of(step, begin, end)` is the step that writes only bytes [begin, end) of the output (at unit boundaries), with
its own reads and held bytes. The engine runs a part by skipping the units outside its range (`Step.part`), the same
walk over the same units, so the bytes each rank writes are the planned ones.
"""

from __future__ import annotations

from typing import Any

from ..catalog import TensorInfo
from .schedule import COPY, PIECES, ROWS, SourceAccess, Step


def row_chunks(job: object, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(input index, first row, rows) of each chunk a ROWS step converts, in order (`engine.rows` walks the same)."""
    per = job.chunk_rows(job.budget(chunk_bytes))  # type: ignore[attr-defined]
    rows = job.rows  # type: ignore[attr-defined]
    return [(k, first, min(per, rows - first)) for k in range(len(job.inputs)) for first in range(0, rows, per)]  # type: ignore[attr-defined]


def _copy_unit(step: Step, chunk_bytes: int) -> int:
    """A byte copy is cut into units of whole rows of its output, at least `chunk_bytes` (the chunk size) each."""
    out = step.group.outputs[0]
    row = max(out.nbytes // out.shape[0] if out.shape and out.shape[0] else out.nbytes, 1)
    return -(-max(chunk_bytes, 1) // row) * row


def _pieces(group: object, cache: dict | None) -> object:
    """`output_pieces(group)`, found once per group when a `cache` (id -> pieces) is kept across calls."""
    from ..mapper.pieces import output_pieces

    if cache is None:
        return output_pieces(group)
    key = id(group)
    if key not in cache:
        cache[key] = (group, output_pieces(group))  # the group is kept so its id stays its own
    return cache[key][1]


def units(step: Step, access: SourceAccess, chunk_bytes: int, cache: dict | None = None) -> list[int] | None:
    """Bytes of each unit of `step`'s one output, in order, when it can be cut between units; None otherwise.
    `cache`: a dict kept across calls (and given to `part_of`), so a stack's pieces are found once."""
    group = step.group
    if step.run or step.batch is not None or step.part is not None or len(group.outputs) != 1 or step.bytes_out < 2:
        return None
    if step.kind == PIECES:
        pieces = _pieces(group, cache)
        return None if pieces is None else [p.rows * pieces.row_bytes for p in pieces.pieces]  # type: ignore[attr-defined]
    if step.kind == ROWS:
        from ..mapper.row_jobs import row_job

        job = row_job(group)
        if job is None:
            return None
        return [n * job.out_row for _, _, n in row_chunks(job, chunk_bytes)]
    if step.kind == COPY and group.recipe is not None and len(group.recipe) == 1 and all(access.located(t) for t in group.inputs):
        unit, size = _copy_unit(step, chunk_bytes), step.bytes_out
        return [min(unit, size - at) for at in range(0, size, unit)]
    return None


def _add(reads: dict[str, int], file: str, n: int) -> None:
    if n:
        reads[file] = reads.get(file, 0) + n


def part_of(step: Step, begin: int, end: int, access: SourceAccess, chunk_bytes: int, cache: dict | None = None) -> Step:
    """The step writing bytes [begin, end) of `step`'s one output (unit boundaries), its reads and held bytes its own."""
    group = step.group
    reads: dict[str, int] = {}
    held = step.held_bytes
    if step.kind == PIECES:
        pieces: Any = _pieces(group, cache)
        assert pieces is not None
        at, held = 0, 0
        for piece in pieces.pieces:
            size = piece.rows * pieces.row_bytes
            if begin <= at < end:
                for info in piece.sources().values():
                    _add(reads, info.file, info.nbytes)
                held = max(held, piece.held_bytes(pieces.row_bytes))
            at += size
    elif step.kind == ROWS:
        from ..mapper.row_jobs import row_job

        job = row_job(group)
        assert job is not None
        at, seen = 0, set()
        for k, _first, n in row_chunks(job, chunk_bytes):
            if begin <= at < end:
                _add(reads, job.inputs[k].file, n * job.in_row)
                if k not in seen:
                    seen.add(k)
                    for extra in job.whole(k):
                        _add(reads, extra.file, extra.nbytes)
            at += n * job.out_row
    else:  # COPY: the slices' bytes that fall in the range
        by_name: dict[str, TensorInfo] = {t.name: t for t in group.inputs}
        ((_, slices),) = group.recipe.items()
        at = 0
        for piece in slices:
            lo, hi = max(at, begin), min(at + piece.length, end)
            if hi > lo:
                _add(reads, by_name[piece.source].file, hi - lo)
            at += piece.length
        held = 0
    return Step(step.index, group, step.kind, held, reads, end - begin, files=step.files, rank=step.rank, part=(begin, end))


__all__ = ["part_of", "row_chunks", "units"]

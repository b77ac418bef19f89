"""Running a PIECES step: one output stacked from computed pieces (`mapper.pieces`), a piece at a time.

Each piece reads its own source tensors, is computed with torch, written at its byte range of the output slot and
freed before the next one is read, so the step holds what its largest piece needs (the plan's `held_bytes`), not
the whole output and every input at once.
"""

from __future__ import annotations

from ..errors import PlanError
from ..iostats import read_into
from ..mapper.pieces import output_pieces, row_range
from ..overflow import collect
from ..planning.schedule import Step
from .steps import WRITEBACK_PIECE, RankContext, _as_tensor, _record_overflow, read_buffer


def run_pieces(ctx: RankContext, step: Step) -> None:
    """Compute the step's output piece by piece, each written at its place in the output and then freed."""
    import torch

    group = step.group
    pieces = output_pieces(group)
    if pieces is None:
        raise PlanError(f"Cannot run step {step.index}: its output is no longer a stack of computed pieces. Plan again.")
    out = pieces.output
    target = ctx.target(out.name)
    if target is None:
        return
    writer = target[0]
    ctx.held.hold(step.held_bytes)
    try:
        at = 0
        low, high = step.part or (0, out.nbytes)  # a part (`planning.parts`): only the pieces that start in it
        for piece in pieces.pieces:
            if not low <= at < high:
                at += piece.rows * pieces.row_bytes
                continue
            buffers = []

            def read(info, rows=None, buffers=buffers):  # noqa: ANN001, ANN202 - a piece's source tensors, read when it needs them
                if rows is not None:  # dim-0 rows of a source raw on disk (the plan made row blocks only then)
                    fd, begin = ctx.locate(info)  # type: ignore[misc]
                    sliced = row_range(info, *rows)
                    buffer = bytearray(sliced.nbytes)
                    if sliced.nbytes:  # at the rows' offset from where the reader says the tensor starts
                        read_into(fd, memoryview(buffer), begin + sliced.begin - info.begin)
                    info = sliced
                else:
                    buffer = read_buffer(ctx, info)
                buffers.append(buffer)
                return _as_tensor(buffer, info)

            with collect() as found:
                tensor = piece.compute(read)
            _record_overflow(ctx, group, found)
            data = tensor.contiguous().view(-1).view(torch.uint8).numpy()
            if data.nbytes != piece.rows * pieces.row_bytes:
                raise PlanError(f"Cannot write {out.name!r}: a piece came out as {data.nbytes} bytes, not the "
                                f"{piece.rows * pieces.row_bytes} the plan laid out. The op's inference and its apply disagree.",
                                tensor=out.name)
            writer.write(out.name, data.data, at)
            if data.nbytes >= WRITEBACK_PIECE:
                writer.start_writeback(out.name, at, data.nbytes)
            at += data.nbytes
            ctx.done_bytes += data.nbytes
            del tensor, data, buffers
    finally:
        ctx.held.release(step.held_bytes)

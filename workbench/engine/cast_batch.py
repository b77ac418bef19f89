"""Running a batch of small float32 -> bfloat16 casts as one read, one conversion and one write.

The planner marks the batches (`planning.runs.batch_casts`): consecutive cast steps whose inputs are
adjacent in one source file and whose outputs are adjacent in one output file. The batch's bytes
go through the rank's cast arena like one chunk of a larger cast (read and converted a block at a time), so the memory held is what the
plan counted for each of its steps. A batch holding a NaN or a value that overflows bfloat16 is cast
tensor by tensor instead (torch encodes NaN, overflow is reported per tensor): output bytes never
depend on how tensors were batched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..catalog import TensorInfo

if TYPE_CHECKING:  # pragma: no cover
    from .steps import RankContext


def run_cast_batch(ctx: RankContext, pairs: Sequence[tuple[TensorInfo, TensorInfo]],
                   cast_one: Callable[[RankContext, TensorInfo, TensorInfo], None]) -> None:
    """Cast the batch `pairs` (source, output) (a batch's first step) or nothing (its other steps: no pairs)."""
    if not pairs:
        return
    first_in, first_out = pairs[0]
    target = ctx.target(first_out.name)
    where = ctx.locate(first_in)
    if target is None or where is None:
        for src, out in pairs:
            cast_one(ctx, src, out)
        return
    writer, file_offset = target
    fd, begin = where
    n_in = n_out = count = 0
    parts = []
    for src, out in pairs:
        n_in += src.nbytes
        n_out += out.nbytes
        count += src.numel
        parts.append((out.name, 0, out.nbytes))
    buffers = ctx.cast
    buffers.reserve(n_in + n_out)
    _, slot = buffers.output(n_out, n_in)  # beyond the input's bytes, where the converter stages what it reads
    if buffers.bf16_converter()(fd, begin, slot, count) != (0, 0.0):  # a NaN, or values beyond bfloat16: tensor by tensor
        for src, out in pairs:
            cast_one(ctx, src, out)
        return
    write_span = getattr(writer, "write_span", None)
    if write_span is not None:
        write_span(file_offset, slot, parts)
    else:
        at = 0
        for name, _, length in parts:
            writer.write(name, slot[at : at + length])
            at += length
    ctx.done_bytes += n_out

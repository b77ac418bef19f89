"""Running a ROWS step: one GGUF tensor read, permuted, converted and written a chunk of rows at a time.

The inputs lie raw on disk (the planner makes a ROWS step only then); each chunk of whole rows (whole heads
when the q/k rows are permuted) is read into one reused buffer, converted by `mapper.gguf_rows.convert_rows`
(numpy, ml_dtypes and the `gguf` package's quantisers; no torch) and written at its place in the output slot.
Stacked experts are read one after another into consecutive rows of the output. FP8 inputs (the preset's
de-quantisation ahead of the conversion) have their float32 scale grid read whole, and each chunk is
de-quantised into float32 (`mapper.gguf_fp8.dequantize_rows`) before it is converted. The ledger holds the
bytes the planner counted for the step (`RowJob.held_bytes`), which bounds what the chunk loop allocates.
"""

from __future__ import annotations

from ..catalog import TensorInfo
from ..dtypes import nbytes_of
from ..errors import PlanError
from ..iostats import read_into
from ..mapper.presets.gguf_fp8 import dequantize_rows
from ..mapper.presets.gguf_rows import convert_rows, numpy_dtype, row_budget, row_bytes, row_job
from ..overflow import may_overflow
from ..planning.schedule import Step
from .steps import WRITEBACK_PIECE, RankContext


def run_rows(ctx: RankContext, step: Step) -> None:
    """Convert the step's GGUF tensor in row chunks holding at most `row_budget(options.chunk_bytes)` bytes."""
    import numpy as np

    job = row_job(step.group)
    if job is None:
        raise PlanError(f"Cannot run step {step.index}: its group is not a GGUF row conversion any more. Plan again.")
    out = job.output
    target = ctx.target(out.name)
    if target is None or not job.rows:
        return
    writer = target[0]
    per = job.chunk_rows(row_budget(ctx.plan.options.chunk_bytes))
    src_dtype = job.inputs[0].dtype
    in_row, out_row = nbytes_of(src_dtype, job.cols), row_bytes(job.cols, job.kind)
    counted = may_overflow("F32" if job.scales else src_dtype, job.kind)
    held = job.held(per)
    ctx.held.hold(held)
    try:
        buffer = bytearray(per * in_row)
        scratch = np.empty(per * job.cols, np.float32)
        dequantized = np.empty(per * job.cols, np.float32) if job.scales else None
        dtype = numpy_dtype(src_dtype)
        at = 0
        for k, info in enumerate(job.inputs):
            fd, begin = _located(ctx, info)
            if job.scales:
                scale_fd, scale_begin = _located(ctx, job.scales[k])
                grid = bytearray(job.scales[k].nbytes)
                read_into(scale_fd, memoryview(grid), scale_begin)
                scales = np.frombuffer(grid, dtype=np.float32).reshape(-1, job.scales[k].shape[-1])
            for first in range(0, job.rows, per):
                n = min(per, job.rows - first)
                view = memoryview(buffer)[: n * in_row]
                read_into(fd, view, begin + first * in_row)
                rows = np.frombuffer(view, dtype=dtype).reshape(n, job.cols)
                if dequantized is not None:
                    rows = dequantize_rows(rows, scales, first, job.block, dequantized)
                heads = n // job.unit if job.heads else 0
                data, count, largest = convert_rows(rows, job.kind, heads, scratch, counted)
                ctx.overflowed(out.name, job.kind, count, largest)
                writer.write(out.name, data.data, at)
                if data.nbytes >= WRITEBACK_PIECE:  # on its way to disk before the commit's fsync
                    writer.start_writeback(out.name, at, data.nbytes)
                at += n * out_row
                ctx.done_bytes += n * out_row
    finally:
        ctx.held.release(held)


def _located(ctx: RankContext, info: TensorInfo) -> tuple[int, int]:
    """(file descriptor, offset) of a step input's raw bytes; PlanError when they are not raw any more."""
    where = ctx.locate(info)
    if where is None:
        raise PlanError(f"Cannot convert {info.name!r} to GGUF in row chunks: its bytes are no longer raw in "
                        f"{info.file}. Plan again.", tensor=info.name)
    return where
